"""Engine: validates and queues requests, runs scheduler -> runner steps, applies stop rules and
produces outputs. It owns the scheduler, the KV manager, the model runner and the output states."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.config import EngineArgs, EngineConfig
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.outputs import RequestOutput, RequestState
from kvserve.engine.parallel_sampling import ParentRequest
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.state_cache import StateSnapshotCache
from kvserve.logger import init_logger

if TYPE_CHECKING:
    from kvserve.runner.model_runner import PendingSamples

logger = init_logger(__name__)

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
PromptInput = str | list[int] | dict[str, Any]


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# vLLM's text for text prompts (and chat) without a tokenizer (``InputPreprocessor`` / renderer).
NO_TOKENIZER_TEXT_PROMPT = "You cannot pass text prompts when `skip_tokenizer_init=True`"


def _generation_eos_ids(model_path: str) -> list[int]:
    """EOS ids of the generation config, as vLLM's ``try_get_generation_config``: the folder's
    ``generation_config.json``, else the one transformers derives from ``config.json``
    (``GenerationConfig.from_model_config``, which copies its ``eos_token_id``)."""
    folder = Path(model_path)
    eos = None
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            break
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        from kvserve.runner.model_runner import ModelRunner

        self.config = config
        # skip_tokenizer_init (config.tokenizer is None): no tokenizer, token-id prompts only, no
        # output text (vLLM: the detokenizer is a no-op, the EOS id of the tokenizer is None and
        # only the generation config's EOS ids stop a request, as stop token ids).
        self.tokenizer: Any = None if config.tokenizer is None else load_tokenizer(config.tokenizer)
        # the Rust tokenizer decodes much faster than the Python wrapper; same text
        self.decoder = getattr(self.tokenizer, "backend_tokenizer", None) or self.tokenizer
        if self.tokenizer is None:
            logger.warning("Using None for EOS token id because tokenizer is not initialized")
        self.eos_token_id: int | None = None if self.tokenizer is None else self.tokenizer.eos_token_id
        self.extra_eos_ids = _generation_eos_ids(config.model_config.model)
        self.runner = ModelRunner(config)
        cc = config.cache_config
        snapshots = None
        if self.runner.num_snapshot_slots:  # hybrid prefix caching: the GDN states a hit resumes from
            snapshots = StateSnapshotCache(self.runner.num_snapshot_slots, self.runner.snapshot_interval)
        elif self.runner.gdn_layers:  # a cached prefix without its recurrent state would be wrong
            cc.enable_prefix_caching = False
        self.kv_manager = KVCacheManager(cc.num_blocks, cc.block_size, cc.enable_prefix_caching, snapshots)
        self.scheduler = Scheduler(config.scheduler_config, self.kv_manager)
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        # async scheduling: the step launched last, whose tokens are processed during the next one
        self.async_scheduling = config.scheduler_config.async_scheduling
        self._pending: tuple[SchedulerOutput, "PendingSamples"] | None = None
        self._deferred: list[RequestOutput] = []  # outputs held back by a failed launch
        self._sync_ids: set[str] = set()  # live requests whose sampling needs host state (see _needs_sync)
        self.runner.host_state_requests = self._sync_ids
        self.vocab_size = config.model_config.vocab_size
        self._max_model_len = config.model_config.max_model_len
        if self.tokenizer is not None:
            self.vocab_size = max(self.vocab_size, len(self.tokenizer))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "Engine":
        return cls(args.create_engine_config())

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Prompt text (None for token prompts) and its token ids."""
        text: str | None = None
        ids: Any = prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif isinstance(prompt.get("prompt"), str):
                ids = prompt["prompt"]
        if isinstance(ids, str):
            if self.tokenizer is None:
                raise ValueError(NO_TOKENIZER_TEXT_PROMPT)
            return ids, list(self.tokenizer(ids).input_ids)
        if isinstance(ids, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return text, list(ids)
        raise ValueError(
            f"Invalid prompt {prompt!r}: expected a string, a list of int token ids, or a dict with "
            "'prompt' (str) or 'prompt_token_ids' (list of int)."
        )

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> None:
        """Validate and queue a request; raises ValueError (and changes nothing) on bad input."""
        if request_id in self.states or request_id in self.parents:
            raise ValueError(f"Request id {request_id!r} already exists.")
        prompt_text, ids = self.tokenize(prompt)
        max_len = self.config.model_config.max_model_len
        if not ids:
            raise ValueError("The decoder prompt cannot be empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = max(ids) if max(ids) >= self.vocab_size else min(ids)
            raise ValueError(f"Token id {bad} is out of vocabulary")
        if len(ids) > max_len:
            raise ValueError(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model length "
                f"of {max_len}. Make sure that `max_model_len` is no smaller than the number of "
                "text tokens."
            )
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > MAX_LOGPROBS:
                kind = "sample" if name == "logprobs" else "prompt"
                raise ValueError(
                    f"Requested {kind} logprobs of {n}, which is greater than max allowed: {MAX_LOGPROBS}"
                )
        bad_stop = [t for t in params.stop_token_ids or [] if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(
                f"token_id(s) {bad_stop} in stop_token_ids contain out-of-vocab token ids. "
                f"Vocabulary size: {self.vocab_size}"
            )
        params = params.clone()
        if params.max_tokens is None:
            params.max_tokens = max_len - len(ids)
        params.update_from_generation_config(self.eos_token_id, self.extra_eos_ids)
        if params.n == 1:
            self._add_child(request_id, prompt_text, ids, params)
            return
        parent = ParentRequest(request_id, params)
        self.parents[request_id] = parent
        for index in range(params.n):
            child_id, child_params = parent.child(index)
            self._add_child(child_id, prompt_text, ids, child_params, index, parent)

    def _add_child(
        self, request_id: str, prompt: str | None, ids: list[int], params: SamplingParams,
        index: int = 0, parent: ParentRequest | None = None,
    ) -> None:
        if _needs_sync(params):
            self._sync_ids.add(request_id)
        self.states[request_id] = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.decoder, ids, params),
            tokenizer=self.decoder,
            index=index,
            parent=parent,
        )
        self.scheduler.add_request(Request(request_id, ids, params))

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in list(ids):
            parent = self.parents.pop(rid, None)
            if parent is not None:
                ids.extend(parent.children)
        for rid in ids:
            if self.scheduler.abort(rid) is not None:
                self.runner.remove_request(rid)
            self.states.pop(rid, None)
            self._sync_ids.discard(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None or bool(self._deferred)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting

    # ---- stepping -------------------------------------------------------------------------
    def _check_stop(self, req: Request) -> tuple[RequestStatus | None, int | None]:
        """vLLM's order: min_tokens, EOS, stop token ids, then the length caps."""
        params, out = req.sampling_params, req.output_token_ids
        last, num_out = out[-1], len(out)
        if num_out >= params.min_tokens:
            if params.eos_token_id is not None and last == params.eos_token_id:
                return RequestStatus.FINISHED_STOPPED, None
            if last in params.stop_token_ids:  # type: ignore[operator]
                return RequestStatus.FINISHED_STOPPED, last
        if len(req.all_token_ids) >= self._max_model_len or num_out >= (params.max_tokens or 0):
            return RequestStatus.FINISHED_LENGTH_CAPPED, None
        return None, None

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and return the outputs it produced. With async scheduling
        the batch is launched and the outputs returned are those of the step launched before it,
        whose tokens are processed while this one runs on the device."""
        if self._deferred:
            out, self._deferred = self._deferred, []
            return out
        if not self.async_scheduling or self._sync_ids:
            # some live request needs its tokens on the host before the next sampling
            return self._finish_pending() + self._step_sync()
        sched = self.scheduler.schedule()
        launched = None
        if not sched.is_empty:
            try:
                launched = self.runner.execute_async(sched)
            except BaseException:
                self._deferred = self._finish_pending()  # the step before is not lost
                self.abort_request([s.request.request_id for s in sched.scheduled])
                raise
            for s in sched.scheduled:
                if s.samples:
                    s.request.num_pending += 1
        try:
            outputs = self._finish_pending()
        except BaseException:
            # the step before failed on the device: this one, launched behind it, cannot stand
            self.abort_request([s.request.request_id for s in sched.scheduled])
            raise
        if launched is not None:
            self._pending = (sched, launched)
        return outputs

    def _finish_pending(self) -> list[RequestOutput]:
        """Wait for the step launched last and process its tokens."""
        if self._pending is None:
            return []
        sched, launched = self._pending
        self._pending = None
        try:
            results = launched.results()
        except BaseException:  # the device failed the step: its requests cannot go on
            self.abort_request([s.request.request_id for s in sched.scheduled])
            raise
        for s in sched.scheduled:
            if s.request.request_id in results:
                s.request.num_pending -= 1
        # a request that finished (or was aborted) after being scheduled: its token is dropped
        live = [s for s in sched.scheduled if not s.request.is_finished and s.request.request_id in self.states]
        return self._process(live, results, {})

    def _step_sync(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        try:
            results, prompt_logprobs = self.runner.execute(sched)
        except BaseException:
            # The step's KV was not written: its requests cannot go on. Abort them (their blocks
            # and not-yet-confirmed prefix-cache entries are released) and let the caller decide.
            self.abort_request([s.request.request_id for s in sched.scheduled])
            raise
        return self._process(sched.scheduled, results, prompt_logprobs)

    def _process(self, scheduled: list, results: dict, prompt_logprobs: dict) -> list[RequestOutput]:
        """Append each sampled token, apply the stop rules, and build the outputs."""
        outputs: list[RequestOutput] = []
        for s in scheduled:
            req = s.request
            if req.request_id in prompt_logprobs:
                self.states[req.request_id].add_prompt_logprobs(prompt_logprobs[req.request_id])
            res = results.get(req.request_id)
            if res is None:
                continue  # a prefill chunk that did not reach the end of the prompt yet
            req.append_output_token(res.token_id)
            status, stop_reason = self._check_stop(req)
            state = self.states[req.request_id]
            state.token_ids.append(res.token_id)
            if res.logprobs is not None and res.logprob_token_ids is not None:
                state.add_logprobs(res.logprob_token_ids, res.logprobs, res.sampled_rank or 0)
            stop_str = state.detokenizer.update([res.token_id], status == RequestStatus.FINISHED_STOPPED)
            if stop_str is not None:
                status, stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            if status is not None:
                self.scheduler.finish_request(req, status)
                self.runner.remove_request(req.request_id)
                del self.states[req.request_id]
                self._sync_ids.discard(req.request_id)
            out = state.make_output(
                req.num_cached_tokens, status.finish_reason if status is not None else None, stop_reason
            )
            if out is not None:
                outputs.append(out)
                if out.finished and state.parent is not None:
                    self.parents.pop(state.parent.request_id, None)
        return outputs


def _needs_sync(params: SamplingParams) -> bool:
    """Sampling that reads host state one step late under async scheduling: penalties (the output
    ids) and logprobs (computed on the host). Such requests run their steps synchronously."""
    return (
        params.logprobs is not None
        or params.prompt_logprobs is not None
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )
