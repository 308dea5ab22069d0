"""AsyncLLM: per-request asyncio streams of DELTA outputs over one engine (vLLM v1's AsyncLLM).

Two ways to drive the engine, one public API:

- the core in its own process (``kvserve serve``): everything runs on the caller's event loop, as
  vLLM's front end does. Adds, aborts and calls go straight to the ``Engine`` (its ``CoreClient``
  sends them); an output-handler task awaits the core's messages on an asyncio view of the same
  ZeroMQ socket and turns each into ``RequestOutput``s (``Engine.process_core_outputs``: text, stop
  strings) and into the requests' collectors ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` at a time (yielding to
  the loop between chunks): no thread, no hand-off between threads.
- the core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, tests): the step loop on a
  background thread, the only one that touches the ``Engine``; callers talk to it through a
  thread-safe inbox of commands (add / abort / call / stop) and outputs come back through
  ``loop.call_soon_threadsafe``, one wake-up per event loop per step.

Either way a request's outputs wait in a one-slot collector (a consumer that falls behind gets the
steps it missed as one output); validation errors of ``add_request`` reach the caller of
``generate`` as the original exception; a failing step aborts the requests of that step (the engine
frees their blocks) and delivers the error to their streams, and the engine goes on; a dead engine
fails every stream with ``EngineDeadError`` and refuses new work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
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
    """Called where outputs are processed: the event loop, or the engine thread of an in-process
    core (must be thread-safe and quick)."""

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None: ...
    def on_token_interval(self, itl_s: float, num_tokens: int) -> None: ...
    def on_finished(self, finish_reason: str, e2e_s: float, num_generation_tokens: int) -> None: ...
    def on_iteration(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """Once per engine step that gave tokens: the prompts that got their first token in it, and
        the tokens it generated (vLLM's iteration stats)."""


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


_ABORTED = object()  # a stream's last item when another caller aborted its request


def _running_in(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the caller runs on ``loop`` (its thread, inside it)."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


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


# outputs turned into RequestOutputs per turn of the event loop (vLLM's variable and default)
OUTPUT_PROC_CHUNK_SIZE = int(os.environ.get("VLLM_V1_OUTPUT_PROC_CHUNK_SIZE", "128"))
_DEAD_POLL_MS = 100  # the output handler looks at the core's health this often while no output comes


class AsyncLLM:
    """``generate(prompt, params, request_id)`` streams DELTA outputs; many requests batch together."""

    def __init__(self, engine: Engine, *, start: bool = True) -> None:
        self.engine = engine
        # the core in its own process: the front end's work on the event loop (module docstring)
        self._on_loop = engine.multiprocess
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # the engine thread's, or the event loop's
        self._observers: list[StatObserver] = []
        self._stopped = threading.Event()
        self._dead: BaseException | None = None
        self._handler: asyncio.Task | None = None  # on_loop: the output handler, on its loop
        self._iteration_tokens = [0, 0]  # this step's (prompt, generated) tokens, for on_iteration
        self.stats = EngineStats()
        self._update_stats()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        if start and not self._on_loop:
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
        if self._on_loop:
            return self._dead is None and not self._stopped.is_set() and self.engine.is_alive()
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
        if self._on_loop:
            self._ensure_output_handler()
            self._add(request_id, prompt, params, stream)
            return self._iterate(request_id, stream)
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
                if item is _ABORTED:  # aborted by another caller: the stream ends here
                    finished = True
                    return
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
        core's next turn."""
        if self._stopped.is_set():
            return
        if not self._on_loop:
            self._inbox.put(("abort", request_id))
            return
        handler = self._handler
        loop = handler.get_loop() if handler is not None else None
        if loop is not None and not loop.is_closed() and not _running_in(loop):
            loop.call_soon_threadsafe(self._abort, request_id)  # another thread: hand it to the loop
        else:
            self._abort(request_id)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` where the engine is driven (the event loop, or the engine thread of an
        in-process core; e.g. tokenizer work) and return its result."""
        self._check_alive()
        if self._on_loop:
            return fn(self.engine)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._on_loop:
            self._stopped.set()
            handler, self._handler = self._handler, None
            if handler is not None and not handler.done():
                loop = handler.get_loop()
                if not loop.is_closed():
                    loop.call_soon_threadsafe(handler.cancel)
            self._fail_all(self._dead or EngineDeadError("The engine was shut down."))
        elif self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)
        self.engine.shutdown()

    def _check_alive(self) -> None:
        if self._on_loop and self._dead is None and not self._stopped.is_set() and not self.engine.is_alive():
            raise EngineDeadError(str(self._core_dead_error()))
        if self._dead is not None or self._stopped.is_set():
            raise EngineDeadError("The engine loop is not running.") from self._dead

    # ---- the event loop's engine (core in its own process) ---------------------------------
    def _ensure_output_handler(self) -> None:
        """Start the output handler on the running loop (again, if an earlier loop ended)."""
        loop = asyncio.get_running_loop()
        handler = self._handler
        if handler is not None and not handler.done() and handler.get_loop() is loop:
            return
        self._handler = loop.create_task(self._output_handler(), name="kvserve-output-handler")

    async def _output_handler(self) -> None:
        """Await the core's messages and turn them into outputs for the streams; a dead core fails
        every stream."""
        import zmq
        import zmq.asyncio

        client = self.engine.core
        sock = zmq.asyncio.Socket.from_socket(client.output_socket)  # an asyncio view of the same socket
        try:
            while True:
                if not await sock.poll(_DEAD_POLL_MS, zmq.POLLIN):
                    if not self.engine.is_alive():
                        raise self._core_dead_error()
                    continue
                while True:  # everything queued, without waiting again
                    try:
                        frame = client.output_socket.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    out = client.decode(frame)
                    if out.stats is not None:
                        client.stats = out.stats
                        self._update_stats()
                    if out.outputs or out.error is not None:
                        await self._handle_core_outputs(out)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the core is gone (or a bug here): fail everyone, refuse new work
            if not isinstance(e, EngineDeadError):
                logger.exception("The output handler died: %s", e)
            self._dead = e
            self._fail_all(e)

    async def _handle_core_outputs(self, out: Any) -> None:
        """A message's outputs detokenized and delivered ``OUTPUT_PROC_CHUNK_SIZE`` at a time, the loop
        free to write what is ready between chunks (vLLM's output handler)."""
        now = time.monotonic()
        error = None
        for start in range(0, max(1, len(out.outputs)), OUTPUT_PROC_CHUNK_SIZE):
            if start:
                await asyncio.sleep(0)
            outputs, error = self.engine.process_core_outputs(out, start, start + OUTPUT_PROC_CHUNK_SIZE)
            for o in outputs:
                stream = self._take_output(o, now)
                if stream is not None:
                    stream.collector.put_nowait(o)
        self._notify_iteration()
        if error is not None:  # the core's text: "Engine step failed: ..."
            self._fail_step(error)

    def _add(self, rid: str, prompt: PromptInput, params: SamplingParams, stream: _Stream) -> None:
        if rid in self._streams:
            raise ValueError(f"Request id {rid!r} already exists.")
        self.engine.add_request(rid, prompt, params)
        self._streams[rid] = stream

    def _abort(self, rid: str) -> None:
        stream = self._streams.pop(rid, None)
        if stream is None and not self._alive_in_engine(rid):
            return  # finished or never added: nothing to tell the core (the server aborts every id it closes)
        try:
            self.engine.abort_request(rid)
        except EngineDeadError:
            pass  # nothing left to free
        if stream is not None:
            self._notify_finished(stream, "abort")
            self._put(stream, _ABORTED)  # its reader, if it is not the one who aborted, stops

    def _core_dead_error(self) -> EngineDeadError:
        return self.engine.core.dead_error()

    def _fail_all(self, err: BaseException) -> None:
        for rid in list(self._streams):
            self._fail(rid, err)
        self._update_stats()

    # ---- engine thread (core in this process) ----------------------------------------------
    def _update_stats(self) -> None:
        if self._on_loop:  # the core's last report; reading more here would take the handler's messages
            import msgspec

            s = msgspec.structs.asdict(self.engine.core.stats)
        else:
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
                self._add(rid, prompt, params, stream)
            except BaseException as e:
                fut.set_exception(e)
                return
            fut.set_result(None)
        elif kind == "abort":
            self._abort(cmd[1])
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

    def _fail_step(self, error: str) -> None:
        """A failed step (``error``: what its streams get): its requests are gone from the engine."""
        logger.error("%s; aborting the affected requests", error)
        for rid in list(self._streams):
            if not self._alive_in_engine(rid):
                self.engine.abort_request(rid)  # drop any remaining parent bookkeeping
                self._fail(rid, RuntimeError(error))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineDeadError:
            raise  # the core process is gone: the loop ends and every stream gets the error
        except Exception as e:  # the engine aborted the step's requests; tell their streams
            logger.exception("Engine step failed")
            text = str(e)  # a core process's report already says so
            self._fail_step(text if text.startswith("Engine step failed") else f"Engine step failed: {e}")
            return
        now = time.monotonic()
        # one wake-up per event loop per step (not one per request): cheaper on a busy CPU
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_OutputCollector, RequestOutput]]] = {}
        for out in outputs:
            stream = self._take_output(out, now)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.collector, out))
        self._notify_iteration()
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass

    def _take_output(self, out: RequestOutput, now: float) -> _Stream | None:
        """The stream an output goes to (None: aborted meanwhile), its statistics recorded; a
        finished request leaves the streams."""
        stream = self._streams.get(out.request_id)
        if stream is None:
            return None
        self._record(stream, out, now)
        if out.finished:
            del self._streams[out.request_id]
            reason = next((c.finish_reason for c in reversed(out.outputs) if c.finish_reason), "stop")
            self._notify_finished(stream, reason, now)
        return stream

    def _fail(self, rid: str, err: BaseException) -> None:
        stream = self._streams.pop(rid, None)
        if stream is not None:
            self._notify_finished(stream, "abort")
            self._put(stream, err)

    @staticmethod
    def _put(stream: _Stream, item: Any) -> None:
        if _running_in(stream.loop):
            stream.collector.put_nowait(item)
        else:
            stream.put(item)

    # ---- statistics ------------------------------------------------------------------------
    def _record(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        for c in out.outputs:
            n = len(c.token_ids)
            if not n:
                continue
            stream.num_generation_tokens += n
            self._iteration_tokens[1] += n
            last = stream.last_token.get(c.index)
            try:
                if not stream.prompt_counted:
                    stream.prompt_counted = True
                    self._iteration_tokens[0] += len(out.prompt_token_ids)
                    for o in self._observers:
                        o.on_first_token(now - stream.arrival, len(out.prompt_token_ids))
                elif last is not None:
                    for o in self._observers:
                        o.on_token_interval(now - last, n)
            except Exception:  # metrics must never break serving
                logger.exception("stat observer failed")
            stream.last_token[c.index] = now

    def _notify_iteration(self) -> None:
        """The step's token counts (gathered by ``_record``) to the observers, then reset."""
        prompt, generated = self._iteration_tokens
        self._iteration_tokens = [0, 0]
        if not (prompt or generated):
            return
        for o in self._observers:
            try:
                o.on_iteration(prompt, generated)
            except Exception:  # metrics must never break serving
                logger.exception("stat observer failed")

    def _notify_finished(self, stream: _Stream, reason: str, now: float | None = None) -> None:
        e2e = (now or time.monotonic()) - stream.arrival
        for o in self._observers:
            try:
                o.on_finished(reason, e2e, stream.num_generation_tokens)
            except Exception:  # metrics must never break serving
                logger.exception("stat observer failed")
