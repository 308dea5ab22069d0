"""OutputProcessor: the engine core's per-step token outputs -> ``RequestOutput``s (vLLM v1's
OutputProcessor). It keeps each request's state (detokenizer, logprobs, what was sent), finds stop
strings in the new text and reports those requests, which the core must then finish; n > 1
parents gather their children here. One pass over a step's outputs, once per request."""

from __future__ import annotations

from typing import Any

from kvserve.engine.core import CoreOutput
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.outputs import RequestOutput, RequestState
from kvserve.engine.parallel_sampling import ParentRequest
from kvserve.engine.request import RequestStatus
from kvserve.engine.sampling import SamplingParams


class OutputProcessor:
    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder  # the tokenizer's fast decoder (None: no text, as skip_tokenizer_init)
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        index: int = 0, parent: ParentRequest | None = None,
    ) -> None:
        self.states[request_id] = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.decoder, prompt_token_ids, params),
            tokenizer=self.decoder,
            index=index,
            parent=parent,
        )

    def expand(self, request_ids: list[str]) -> list[str]:
        """The ids and, for an n > 1 parent, its children (the parent is forgotten)."""
        ids = list(request_ids)
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is not None:
                ids.extend(parent.children)
        return ids

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The step's ``RequestOutput``s, and the requests a stop string finished (still running
        in the core: the caller finishes them there)."""
        results: list[RequestOutput] = []
        stopped: list[str] = []
        states = self.states
        for o in outputs:
            state = states.get(o.request_id)
            if state is None:
                continue  # aborted meanwhile
            if o.prompt_logprobs is not None:
                state.add_prompt_logprobs(o.prompt_logprobs)
            if not o.new_token_ids:
                continue
            status, stop_reason = o.finish_status, o.stop_reason
            state.token_ids.extend(o.new_token_ids)
            if o.new_logprobs is not None:
                state.add_logprobs(*o.new_logprobs)
            stop_str = state.detokenizer.update(o.new_token_ids, status == RequestStatus.FINISHED_STOPPED)
            if stop_str is not None:
                if status is None:
                    stopped.append(o.request_id)
                status, stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            if status is not None:
                del states[o.request_id]
            out = state.make_output(
                o.num_cached_tokens, status.finish_reason if status is not None else None, stop_reason
            )
            if out is not None:
                results.append(out)
                if out.finished and state.parent is not None:
                    self.parents.pop(state.parent.request_id, None)
        return results, stopped
