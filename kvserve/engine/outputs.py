"""Request outputs (vLLM's classes and fields) and the processor that turns engine steps into them.

Every output of a request shares the request's one ``prompt`` string and one ``prompt_token_ids``
list; per step only the new tokens are handled, never anything proportional to the prompt."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.sampling import RequestOutputKind, SamplingParams


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None  # vLLM field; kvserve has no LoRA

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Any = None
    lora_request: Any = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int | None = None
    multi_modal_placeholders: dict[str, Any] = field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = None


    def add(self, later: "RequestOutput") -> None:
        """Fold a later DELTA output of the same request into this one (vLLM's ``RequestOutput.add``
        with ``aggregate``): per choice index, text, token ids and logprobs are appended and the
        later finish state wins; a choice seen only in ``later`` is appended."""
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            prev = mine.get(c.index)
            if prev is None:
                self.outputs.append(c)
                mine[c.index] = c
                continue
            prev.text += c.text
            prev.token_ids = prev.token_ids + c.token_ids
            if c.logprobs is not None:
                prev.logprobs = (prev.logprobs or []) + c.logprobs
            prev.cumulative_logprob = c.cumulative_logprob
            prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens


@dataclass
class RequestState:
    """What the output side keeps per request: shared prompt objects, detokenizer, progress."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    tokenizer: Any
    index: int = 0  # position among the n completions of a parent request
    parent: Any = None  # ParentRequest when n > 1
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    sent_tokens: int = 0  # for DELTA outputs
    sent_logprobs: int = 0
    sent_prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0

    def _entry(self, ids: list[int], values: list[float], rank: int) -> dict[int, Logprob]:
        """The token first with its true rank, then the top-k at ranks 1..k (vLLM's dict)."""
        entry: dict[int, Logprob] = {}
        for tid, val, r in zip(ids, values, [rank] + list(range(1, len(ids)))):
            decoded = (
                self.tokenizer.decode([tid], skip_special_tokens=False)
                if self.params.detokenize and self.tokenizer is not None
                else None
            )
            entry[tid] = Logprob(val, r, decoded)
        return entry

    def add_logprobs(self, ids: list[int], values: list[float], rank: int) -> None:
        assert self.logprobs is not None and self.cumulative_logprob is not None
        self.cumulative_logprob += values[0]
        self.logprobs.append(self._entry(ids, values, rank))

    def add_prompt_logprobs(self, rows: list[tuple[list[int], list[float], int]]) -> None:
        """Rows for the next prompt positions; the first prompt token has no logprob (None)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        for ids, values, rank in rows:
            if len(self.prompt_logprobs) < len(self.prompt_token_ids):  # a recompute after preemption adds nothing
                self.prompt_logprobs.append(self._entry(ids, values, rank))

    def make_output(
        self, num_cached_tokens: int | None, finish_reason: str | None, stop_reason: int | str | None
    ) -> RequestOutput | None:
        kind = self.params.output_kind
        finished = finish_reason is not None
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta)
        if delta:
            token_ids = self.token_ids[self.sent_tokens :]
            logprobs = self.logprobs[self.sent_logprobs :] if self.logprobs is not None else None
            self.sent_tokens = len(self.token_ids)
            self.sent_logprobs = len(self.logprobs) if self.logprobs is not None else 0
            if not token_ids and not text and not finished:
                return None
        else:
            token_ids = list(self.token_ids)
            logprobs = list(self.logprobs) if self.logprobs is not None else None
        completion = CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        prompt_logprobs = self.prompt_logprobs
        if delta:
            prompt_logprobs = None if self.sent_prompt_logprobs else prompt_logprobs
            self.sent_prompt_logprobs = self.sent_prompt_logprobs or prompt_logprobs is not None
        outputs, request_id = [completion], self.request_id
        if self.parent is not None:
            outputs, finished = self.parent.get_outputs(self.request_id, completion)
            request_id = self.parent.request_id
            if not outputs:
                return None
        return RequestOutput(
            request_id=request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=num_cached_tokens,
        )
