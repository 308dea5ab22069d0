"""Token-budget scheduler (vLLM v1 style): running requests first, then waiting ones; prefill
chunks and decodes share one step; preemption by recompute when KV blocks run out."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # tokens already in the KV cache before this step
    num_new_tokens: int  # tokens computed this step
    block_ids: list[int]  # the KV manager's live list: read it during this step only
    # this step reaches the end of the tokens (known or pending), so a new token is sampled
    samples: bool = False
    # hybrid prefix caching: the snapshot slot whose state this request resumes from (a cache hit),
    # and the one its state is copied to after this step (the step ends on a snapshot position)
    restore_state_from: int | None = None
    save_state_to: int | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        max_tokens = request.sampling_params.max_tokens
        # the length at which the request ends by max_tokens or max_model_len (async scheduling
        # does not schedule a request whose pending token reaches it)
        request.max_total_tokens = min(
            self.config.max_model_len,
            request.num_prompt_tokens + (max_tokens if max_tokens is not None else self.config.max_model_len),
        )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        # Being asked for a new step means the previous one completed (or, with async scheduling,
        # was launched: everything this step launches runs after it on the device's stream), so
        # the blocks it cached hold valid K/V by the time anything reads them.
        self.kv.confirm_cached_blocks()
        budget = cfg.max_num_batched_tokens
        out = SchedulerOutput()
        plan: list[tuple[Request, int, int, int | None, int | None]] = []
        hybrid_caching = self.kv.snapshots is not None  # steps end on state-snapshot positions

        # 1. Running requests, in order; the last one is preempted when blocks run out.
        i, running, allocate = 0, self.running, self.kv.allocate_slots
        while i < len(running) and budget > 0:
            req = running[i]
            known, pending = len(req.all_token_ids), req.num_pending
            num_new = min(known + pending - req.num_computed_tokens, budget)
            if num_new <= 0 or (pending and known + pending >= req.max_total_tokens):
                i += 1
                continue
            if hybrid_caching and num_new > 1:
                num_new = self.kv.align_prefill(req, req.num_computed_tokens, num_new)
            while not allocate(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                plan.append((req, req.num_computed_tokens, num_new, None, None))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted

        # 2. Waiting requests, FCFS, while there is budget, room and no preemption this step.
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
                req = self.waiting[0]
                if req.num_pending:
                    break  # preempted with a token still on the device: admitted once it is known
                hits, num_hit_tokens = self.kv.get_computed_blocks(req)
                num_new = req.num_tokens - num_hit_tokens
                if num_new > budget and not cfg.enable_chunked_prefill:
                    break
                junction = self.kv.prefix_junction(req, num_hit_tokens) if hybrid_caching else None
                num_new = self.kv.align_prefill(req, num_hit_tokens, min(num_new, budget), junction)
                if not self.kv.allocate_slots(req, num_new, hits):
                    break
                self.waiting.popleft()
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit_tokens
                req.num_computed_tokens = num_hit_tokens
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                plan.append((req, num_hit_tokens, num_new, self.kv.snapshot_to_restore(req, num_hit_tokens), junction))
                budget -= num_new

        block_ids_view, scheduled = self.kv.block_ids_view, out.scheduled
        for req, num_computed, num_new, restore, junction in plan:
            end = num_computed + num_new
            samples = end == len(req.all_token_ids) + req.num_pending
            scheduled.append(ScheduledRequest(
                req, num_computed, num_new, block_ids_view(req.request_id), samples,
                restore, self.kv.snapshot_to_save(req, end, junction) if hybrid_caching else None,
            ))
            req.num_computed_tokens = end
        return out

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Finish (stop, length, abort) a request wherever it is; frees its blocks at once."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = status
        if status == RequestStatus.FINISHED_ABORTED:
            # An abort before the next step may follow a step that failed or was interrupted
            # (Ctrl-C) before writing this request's new K/V: keep those blocks out of the prefix
            # cache, or a later request sharing the prefix would read garbage. (After a step that
            # did complete, this only forgoes caching that one step's blocks of an aborted request.)
            self.kv.uncache_unconfirmed(request)
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return req

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
