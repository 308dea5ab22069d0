"""EngineCore: the scheduler, the KV manager and the model runner behind one ``step()`` (vLLM v1's
EngineCore). Requests come in as token ids with their (already validated) sampling params; each
step gives one ``CoreOutput`` per request that got a token, prompt logprobs or a finish. Stop token
ids, EOS and the length caps end requests here; text, stop strings and ``RequestOutput`` objects
are the output processor's (``output_processor.py``), which finishes a stop-string match here
through ``finish_requests``. No tokenizer: the same core can run in another process."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from kvserve.config import EngineConfig
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.state_cache import StateSnapshotCache

if TYPE_CHECKING:
    from kvserve.runner.model_runner import PendingSamples

LogprobRow = tuple[list[int], list[float], int]  # [token, top-1..top-n] ids, their logprobs, the token's rank


class CoreOutput(msgspec.Struct, array_like=True, gc=False):
    """One request's news from one step: its new token (none for a prefill chunk that did not
    reach the end of the prompt), logprobs when asked, and why it finished (None: running). A
    msgspec struct: it crosses to the front end as a msgpack array, not a map of field names
    (a seventh of the bytes of a dataclass and about half its decode time: 0.35 vs 0.64 us)."""

    request_id: str
    new_token_ids: list[int]
    finish_status: RequestStatus | None = None
    stop_reason: int | None = None  # the stop token id that ended it
    new_logprobs: LogprobRow | None = None
    prompt_logprobs: list[LogprobRow] | None = None
    num_cached_tokens: int = 0


def needs_sync(params: SamplingParams) -> bool:
    """Sampling that reads host state one step late under async scheduling: penalties (the output
    ids) and logprobs (computed on the host). Such requests run their steps synchronously."""
    return (
        params.logprobs is not None
        or params.prompt_logprobs is not None
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        from kvserve.runner.model_runner import ModelRunner

        self.config = config
        self.runner = ModelRunner(config)
        cc = config.cache_config
        snapshots = None
        if self.runner.num_snapshot_slots:  # hybrid prefix caching: the GDN states a hit resumes from
            snapshots = StateSnapshotCache(self.runner.num_snapshot_slots, self.runner.snapshot_interval)
        elif self.runner.gdn_layers:  # a cached prefix without its recurrent state would be wrong
            cc.enable_prefix_caching = False
        self.kv_manager = KVCacheManager(cc.num_blocks, cc.block_size, cc.enable_prefix_caching, snapshots)
        self.scheduler = Scheduler(config.scheduler_config, self.kv_manager)
        # async scheduling: the step launched last, whose tokens are processed during the next one
        self.async_scheduling = config.scheduler_config.async_scheduling
        self._pending: tuple[SchedulerOutput, "PendingSamples"] | None = None
        self._deferred: list[CoreOutput] = []  # outputs held back by a failed launch
        self._failed: list[str] = []  # requests a failed step aborted, until take_failure
        self._sync_ids: set[str] = set()  # live requests whose sampling needs host state (see needs_sync)
        self.runner.host_state_requests = self._sync_ids
        self._max_model_len = config.model_config.max_model_len

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request whose input the caller validated (``Engine.add_request``)."""
        if needs_sync(params):
            self._sync_ids.add(request_id)
        self.scheduler.add_request(Request(request_id, prompt_token_ids, params))

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests wherever they are (aborts; stop strings found by the output processor):
        their KV blocks and state slots are freed at once; unknown ids are ignored."""
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self.scheduler.finish_request(req, status)
                self.runner.remove_request(rid)
            self._sync_ids.discard(rid)

    def take_failure(self) -> tuple[list[CoreOutput], list[str]]:
        """After ``step`` raised: the outputs it held back (the step before the failed one), handed
        out now instead of by the next ``step``, and the requests the failure aborted."""
        out, self._deferred = self._deferred, []
        failed, self._failed = self._failed, []
        return out, failed

    def _abort_step(self, sched: SchedulerOutput) -> None:
        """A step failed (its KV not written, or its tokens lost): its requests cannot go on."""
        ids = [s.request.request_id for s in sched.scheduled]
        self._failed.extend(ids)
        self.finish_requests(ids)

    def stats(self) -> dict[str, int]:
        """Running / waiting requests, free / total KV blocks, preemptions so far."""
        kv, sched = self.kv_manager, self.scheduler
        return {"num_running": sched.num_running, "num_waiting": sched.num_waiting,
                "num_free_blocks": kv.num_free_blocks, "num_total_blocks": kv.pool.num_blocks,
                "num_preemptions": sched.num_preemptions}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None or bool(self._deferred)

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

    def step(self) -> list[CoreOutput]:
        """Schedule one batch, run it, and return what it produced. With async scheduling the batch
        is launched and the outputs returned are those of the step launched before it, whose
        tokens are processed while this one runs on the device. A step that fails aborts its
        requests (their blocks are freed) and raises."""
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
                self._abort_step(sched)
                raise
            for s in sched.scheduled:
                if s.samples:
                    s.request.num_pending += 1
        try:
            outputs = self._finish_pending()
        except BaseException:
            # the step before failed on the device: this one, launched behind it, cannot stand
            self._abort_step(sched)
            raise
        if launched is not None:
            self._pending = (sched, launched)
        return outputs

    def _finish_pending(self) -> list[CoreOutput]:
        """Wait for the step launched last and process its tokens."""
        if self._pending is None:
            return []
        sched, launched = self._pending
        self._pending = None
        try:
            results = launched.results()
        except BaseException:  # the device failed the step: its requests cannot go on
            self._abort_step(sched)
            raise
        for s in sched.scheduled:
            if s.request.request_id in results:
                s.request.num_pending -= 1
        # a request that finished (or was aborted) after being scheduled: its token is dropped
        live = self.scheduler.requests
        return self._process([s for s in sched.scheduled if live.get(s.request.request_id) is s.request], results, {})

    def _step_sync(self) -> list[CoreOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        try:
            results, prompt_logprobs = self.runner.execute(sched)
        except BaseException:
            # The step's KV was not written: its requests cannot go on. Abort them (their blocks
            # and not-yet-confirmed prefix-cache entries are released) and let the caller decide.
            self._abort_step(sched)
            raise
        return self._process(sched.scheduled, results, prompt_logprobs)

    def _process(self, scheduled: list, results: dict, prompt_logprobs: dict) -> list[CoreOutput]:
        """Append each sampled token and apply the stop rules of token ids and lengths."""
        outputs: list[CoreOutput] = []
        for s in scheduled:
            req = s.request
            rid = req.request_id
            res = results.get(rid)
            prompt_lps = prompt_logprobs.get(rid) if prompt_logprobs else None
            if res is None:  # a prefill chunk that did not reach the end of the prompt yet
                if prompt_lps is not None:
                    outputs.append(CoreOutput(rid, [], prompt_logprobs=prompt_lps,
                                              num_cached_tokens=req.num_cached_tokens))
                continue
            req.append_output_token(res.token_id)
            status, stop_reason = self._check_stop(req)
            new_lps = None
            if res.logprobs is not None and res.logprob_token_ids is not None:
                new_lps = (res.logprob_token_ids, res.logprobs, res.sampled_rank or 0)
            outputs.append(CoreOutput(rid, [res.token_id], status, stop_reason, new_lps, prompt_lps,
                                      req.num_cached_tokens))
            if status is not None:
                self.scheduler.finish_request(req, status)
                self.runner.remove_request(rid)
                self._sync_ids.discard(rid)
        return outputs
