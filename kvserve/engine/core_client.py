"""The front end's handle on an engine core in another process (vLLM v1's MPClient): starts the
process (spawn), binds the two ZeroMQ sockets, waits for the ready message, watches the process,
sends requests and receives each step's ``CoreOutputs``. A core that dies (crash, kill, OOM) makes
every later call raise ``EngineDeadError`` within a second; ``shutdown`` ends the process (SIGTERM,
then SIGKILL after the timeout), and a finalizer does so if the client is dropped."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import tempfile
import threading
import time
import uuid
import weakref
from multiprocessing.connection import wait as wait_for
from typing import Any

import zmq

from kvserve.config import EngineConfig
from kvserve.engine import core_messages as msg
from kvserve.engine.exceptions import EngineDeadError
from kvserve.engine.request import RequestStatus
from kvserve.engine.sampling import SamplingParams
from kvserve.logger import init_logger

logger = init_logger(__name__)

READY_TIMEOUT_S = float(os.environ.get("VLLM_ENGINE_READY_TIMEOUT_S", "600"))  # vLLM's variable


def _dead_text(detail: str) -> str:
    return f"EngineCore encountered an issue. See stack trace (above) for the root cause. ({detail})"


def _ipc_address() -> str:
    return f"ipc://{tempfile.gettempdir()}/kvserve-{uuid.uuid4().hex}"


def _stop_process(proc: multiprocessing.process.BaseProcess, ctx: zmq.Context, timeout: float,
                  addresses: tuple[str, ...]) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout)
    if proc.is_alive():
        logger.warning("Engine core process %d did not exit in %.0f s; killing it", proc.pid, timeout)
        proc.kill()
        proc.join(5)
    ctx.destroy(linger=0)
    for address in addresses:  # the ipc socket files the bound sockets left
        try:
            os.unlink(address.removeprefix("ipc://"))
        except FileNotFoundError:
            pass


class CoreClient:
    def __init__(self, config: EngineConfig, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.ctx = zmq.Context()
        self.input_address, self.output_address = _ipc_address(), _ipc_address()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.bind(self.input_address)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(self.output_address)
        mp = multiprocessing.get_context("spawn")  # CUDA does not survive a fork
        child_end, self._parent_end = mp.Pipe(duplex=False)
        from kvserve.engine.core_proc import run_engine_core

        self.proc = mp.Process(target=run_engine_core, name="EngineCore",
                               args=(config, self.input_address, self.output_address, child_end))
        self.proc.start()
        child_end.close()
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, self.ctx, 5.0,
                                           (self.input_address, self.output_address))
        self.dead: str | None = None  # why the core is gone, once it is
        self._closing = False
        self._call_ids = itertools.count(1)
        self._lock = threading.Lock()  # one sender at a time (the socket is not thread-safe)
        try:
            self.ready = self._wait_ready(ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        threading.Thread(target=self._watch, name="kvserve-core-monitor", daemon=True).start()

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.output_socket.poll(100):
                out = self._decode(self.output_socket.recv())
                assert out.ready is not None, "the core's first message is its ready message"
                self.stats = out.stats
                return out.ready
            if not self.proc.is_alive():
                raise RuntimeError("Engine core initialization failed. See root cause above. "
                                   f"Failed core proc(s): {{'EngineCore': {self.proc.exitcode}}}")
        raise TimeoutError(
            "Timed out waiting for engine core processes to start. This is often caused by slow weight loading "
            f"for large models. Waited {timeout:.0f}s (configured by VLLM_ENGINE_READY_TIMEOUT_S). To increase "
            "the timeout, set the environment variable: VLLM_ENGINE_READY_TIMEOUT_S=<seconds>")

    def _watch(self) -> None:
        wait_for([self.proc.sentinel])
        self.proc.join(1)  # reap it: its exit code
        if self.dead is None and not self._closing:
            self.dead = f"engine core process exited with code {self.proc.exitcode}"
            logger.error("Engine core exited unexpectedly (exit code %s)", self.proc.exitcode)

    # ---- requests --------------------------------------------------------------------------
    def _send(self, kind: msg.RequestType, payload: Any) -> None:
        if self.dead is not None:
            raise EngineDeadError(_dead_text(self.dead))
        with self._lock:
            self.input_socket.send_multipart([kind.value, msg.ENCODER.encode(payload)])

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._send(msg.RequestType.ADD, msg.AddRequest(request_id, prompt_token_ids, params,
                                                       sorted(params.all_stop_token_ids)))

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        if self.dead is None and request_ids:
            self._send(msg.RequestType.ABORT, msg.FinishRequests(list(request_ids), status))

    def call_utility(self, method: str, *args: Any) -> int:
        """Send a utility call; its answer comes among the outputs (``utility_call_id``)."""
        call_id = next(self._call_ids)
        self._send(msg.RequestType.UTILITY, msg.UtilityCall(call_id, method, list(args)))
        return call_id

    # ---- outputs ---------------------------------------------------------------------------
    def _decode(self, frame: bytes) -> msg.CoreOutputs:
        if frame == msg.ENGINE_CORE_DEAD:
            self.dead = self.dead or "the engine core reported a fatal error"
            raise EngineDeadError(_dead_text(self.dead))
        return msg.OUTPUTS_DECODER.decode(frame)

    def get_output(self, timeout_s: float | None = None) -> msg.CoreOutputs | None:
        """The next ``CoreOutputs`` (None after ``timeout_s``); raises ``EngineDeadError`` once the
        core is gone (checked every 100 ms while waiting)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_ms = 100 if deadline is None else max(0, min(100, int((deadline - time.monotonic()) * 1000)))
            if self.output_socket.poll(wait_ms):
                out = self._decode(self.output_socket.recv())
                if out.stats is not None:
                    self.stats = out.stats
                return out
            if self.dead is not None:
                raise EngineDeadError(_dead_text(self.dead))
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the core to stop, then make sure it did; idempotent."""
        self._closing = True
        if self.proc.is_alive() and self.dead is None:
            try:
                with self._lock:
                    self.input_socket.send_multipart([msg.RequestType.SHUTDOWN.value, b""], flags=zmq.NOBLOCK)
                self.proc.join(timeout_s)
            except zmq.ZMQError:
                pass
        self.dead = self.dead or "shut down"
        self._finalizer()  # terminate / kill if still running, close the sockets
        self._parent_end.close()
