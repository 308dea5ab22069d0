"""n > 1: a parent request fans out into n child requests (vLLM's ``ParentRequest`` rules)."""

from __future__ import annotations

from kvserve.engine.outputs import CompletionOutput
from kvserve.engine.sampling import RequestOutputKind, SamplingParams


class ParentRequest:
    """Children are ``f"{i}_{request_id}"``; a seeded parent gives child i the seed ``seed + i``.
    Streaming kinds pass each child's output through; FINAL_ONLY waits for all n."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.children: set[str] = set()
        self.final: list[CompletionOutput | None] = [None] * params.n

    def child(self, index: int) -> tuple[str, SamplingParams]:
        params = self.params.clone()
        params.n = 1
        if params.seed is not None:
            params.seed += index
        child_id = f"{index}_{self.request_id}"
        self.children.add(child_id)
        return child_id, params

    def get_outputs(self, child_id: str, output: CompletionOutput) -> tuple[list[CompletionOutput], bool]:
        if output.finished():
            self.children.discard(child_id)
        if self.params.output_kind != RequestOutputKind.FINAL_ONLY:
            outputs = [output]
        else:
            self.final[output.index] = output
            outputs = [] if self.children else [o for o in self.final if o is not None]
        return outputs, not self.children
