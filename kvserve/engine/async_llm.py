"""AsyncLLM: the engine's step loop on a background thread, feeding per-request asyncio streams.

Only the engine thread touches the ``Engine`` (it is not thread-safe). Callers talk to it through
a thread-safe inbox of commands (add / abort / call / stop); outputs come back to each request's
one-slot collector through ``loop.call_soon_threadsafe`` (a consumer that falls behind gets the
steps it missed as one output). Validation errors of ``add_request``
reach the caller of ``generate`` as the original exception (a concurrent Future rides with the add
command). A failing step aborts the requests of that step (the engine frees their blocks) and
delivers the error to their streams; the loop itself keeps running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Protocol

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine, PromptInput
from kvserve.engine.exceptions import EngineDeadError
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling import RequestOutputKind, SamplingParams
from kvserve.logger import init_logger

if TYPE_CHECKING:
    from kvserve.engine.core_client import CoreAddress

logger = init_logger(__name__)


class StatObserver(Protocol):
    """Called on the engine thread (must be thread-safe and quick)."""

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None: ...
    def on_token_interval(self, itl_s: float, num_tokens: int) -> None: ...
    def on_finished(self, finish_reason: str, e2e_s: float, num_generation_tokens: int) -> None: ...


class _OutputCollector:
    """A request's outputs on their way to its consumer, in one slot (vLLM's RequestOutputCollector):
    a consumer that falls behind the engine gets the steps it missed folded into one DELTA output
    (``RequestOutput.add``), one event instead of one per step; an error replaces what waits.
    Used on the consumer's event loop only."""

    def __init__(self) -> None:
        self._item: Any = None
        self._ready = asyncio.Event()

    def put_nowait(self, item: Any) -> None:
        if isinstance(self._item, RequestOutput) and isinstance(item, RequestOutput):
            self._item.add(item)
        elif not isinstance(self._item, BaseException):
            self._item = item
        self._ready.set()

    async def get(self) -> Any:
        await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        return item


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    collector: _OutputCollector
    arrival: float = field(default_factory=time.monotonic)
    last_token: dict[int, float] = field(default_factory=dict)  # per choice index
    num_generation_tokens: int = 0
    prompt_counted: bool = False

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.collector.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass


def _deliver(items: list[tuple[_OutputCollector, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0  # cumulative


class AsyncLLM:
    """``generate(prompt, params, request_id)`` streams DELTA outputs; many requests batch together."""

    def __init__(self, engine: Engine, *, start: bool = True) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._observers: list[StatObserver] = []
        self._stopped = threading.Event()
        self._dead: BaseException | None = None
        self.stats = EngineStats()
        self._update_stats()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, multiprocess: bool = False,
                         core_address: "CoreAddress | None" = None) -> "AsyncLLM":
        """``multiprocess``: the engine core in its own process (``kvserve serve``); this process
        then keeps only the front end's work (tokens in, text and outputs out). ``core_address``: a
        core the serve launcher started for several API servers (``--api-server-count``)."""
        return cls(Engine(args.create_engine_config(), multiprocess=multiprocess or core_address is not None,
                          core_address=core_address))

    # ---- properties for the server ---------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.model_config.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set() and self.engine.is_alive()

    def add_observer(self, observer: StatObserver) -> None:
        self._observers.append(observer)

    # ---- public API (asyncio side) ---------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and wait until the engine accepted it (raises its ``ValueError`` for
        invalid input); returns the async iterator of its DELTA outputs. Closing the iterator
        before the request finished aborts it."""
        self._check_alive()
        params = params.clone()
        params.output_kind = RequestOutputKind.DELTA
        stream = _Stream(asyncio.get_running_loop(), _OutputCollector())
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("add", request_id, prompt, params, stream, added))
        try:
            await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return self._iterate(request_id, stream)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.collector.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped the request
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def generate(
        self, prompt: PromptInput, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield DELTA ``RequestOutput``s until the request finishes. Raises ``ValueError`` for
        invalid input. Leaving early (break, cancellation, closing the generator) aborts it."""
        it = await self.add_request(request_id, prompt, params)
        try:
            async for out in it:
                yield out
        finally:
            await it.aclose()  # type: ignore[attr-defined]

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, non-blocking, idempotent): its KV blocks are freed on the
        engine thread's next turn."""
        if not self._stopped.is_set():
            self._inbox.put(("abort", request_id))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread (e.g. tokenizer work) and return its result."""
        self._check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)
        self.engine.shutdown()

    def _check_alive(self) -> None:
        if self._dead is not None or self._stopped.is_set():
            raise EngineDeadError("The engine loop is not running.") from self._dead

    # ---- engine thread ---------------------------------------------------------------------
    def _update_stats(self) -> None:
        s = self.engine.stats()
        total, free = s["num_total_blocks"], s["num_free_blocks"]
        self.stats = EngineStats(
            num_running=s["num_running"],
            num_waiting=s["num_waiting"],
            kv_cache_usage=1.0 - free / total if total else 0.0,
            num_free_blocks=free,
            num_total_blocks=total,
            num_preemptions=s["num_preemptions"],
        )

    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                try:
                    cmd = self._inbox.get(block=block)
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if cmd[0] == "stop":
                        return
                    self._handle(cmd)
                    try:
                        cmd = self._inbox.get_nowait()
                    except queue.Empty:
                        cmd = None
                if self.engine.has_unfinished_requests():
                    self._step()
                self._update_stats()
        except BaseException as e:  # a bug in the loop itself: fail everyone, refuse new work
            logger.exception("The engine loop died: %s", e)
            self._dead = e
        finally:
            self._stopped.set()
            err = self._dead or EngineDeadError("The engine was shut down.")
            for rid in list(self._streams):
                self._fail(rid, err)
            self._drain_after_stop(err)
            self._update_stats()

    def _drain_after_stop(self, err: BaseException) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                cmd[5].set_exception(EngineDeadError(str(err)))
            elif cmd[0] == "call":
                cmd[2].set_exception(EngineDeadError(str(err)))

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, stream, fut = cmd
            if not fut.set_running_or_notify_cancel():
                return
            try:
                if rid in self._streams:
                    raise ValueError(f"Request id {rid!r} already exists.")
                self.engine.add_request(rid, prompt, params)
            except BaseException as e:
                fut.set_exception(e)
                return
            self._streams[rid] = stream
            fut.set_result(None)
        elif kind == "abort":
            rid = cmd[1]
            stream = self._streams.pop(rid, None)
            self.engine.abort_request(rid)
            if stream is not None:
                self._notify_finished(stream, "abort")
        elif kind == "call":
            _, fn, fut = cmd
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:
                fut.set_exception(e)

    def _alive_in_engine(self, rid: str) -> bool:
        eng = self.engine
        if rid in eng.states:
            return True
        parent = eng.parents.get(rid)
        return parent is not None and any(c in eng.states for c in parent.children)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineDeadError:
            raise  # the core process is gone: the loop ends and every stream gets the error
        except Exception as e:  # the engine aborted the step's requests; tell their streams
            logger.exception("Engine step failed; aborting the affected requests: %s", e)
            for rid in list(self._streams):
                if not self._alive_in_engine(rid):
                    self.engine.abort_request(rid)  # drop any remaining parent bookkeeping
                    self._fail(rid, RuntimeError(f"Engine step failed: {e}"))
            return
        now = time.monotonic()
        # one wake-up per event loop per step (not one per request): cheaper on a busy CPU
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_OutputCollector, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            self._record(stream, out, now)
            if out.finished:
                del self._streams[out.request_id]
                reason = next((c.finish_reason for c in reversed(out.outputs) if c.finish_reason), "stop")
                self._notify_finished(stream, reason, now)
            batches.setdefault(stream.loop, []).append((stream.collector, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass

    def _fail(self, rid: str, err: BaseException) -> None:
        stream = self._streams.pop(rid, None)
        if stream is not None:
            self._notify_finished(stream, "abort")
            stream.put(err)

    # ---- statistics ------------------------------------------------------------------------
    def _record(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        for c in out.outputs:
            n = len(c.token_ids)
            if not n:
                continue
            stream.num_generation_tokens += n
            last = stream.last_token.get(c.index)
            try:
                if not stream.prompt_counted:
                    stream.prompt_counted = True
                    for o in self._observers:
                        o.on_first_token(now - stream.arrival, len(out.prompt_token_ids))
                elif last is not None:
                    for o in self._observers:
                        o.on_token_interval(now - last, n)
            except Exception:  # metrics must never break serving
                logger.exception("stat observer failed")
            stream.last_token[c.index] = now

    def _notify_finished(self, stream: _Stream, reason: str, now: float | None = None) -> None:
        e2e = (now or time.monotonic()) - stream.arrival
        for o in self._observers:
            try:
                o.on_finished(reason, e2e, stream.num_generation_tokens)
            except Exception:  # metrics must never break serving
                logger.exception("stat observer failed")
