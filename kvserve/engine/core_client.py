"""The front end's handle on an engine core in another process (vLLM v1's MPClient): starts the
process (spawn), binds the two ZeroMQ sockets, waits for the ready message, watches the process,
sends requests and receives each step's ``CoreOutputs``. A core that dies (crash, kill, OOM) makes
every later call raise ``EngineDeadError`` within a second; ``shutdown`` ends the process (SIGTERM,
then SIGKILL after the timeout), and a finalizer does so if the client is dropped.

With ``--api-server-count N`` the serve launcher starts the core for N front ends
(``start_core_process``) and each API server process attaches a client to it (``CoreAddress``: its
two addresses, its client index, the core's pid); such a client neither starts nor stops the core."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
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


def _unlink(addresses: tuple[str, ...]) -> None:
    for address in addresses:  # the ipc socket files bound sockets leave
        try:
            os.unlink(address.removeprefix("ipc://"))
        except FileNotFoundError:
            pass


def stop_process(proc: multiprocessing.process.BaseProcess, timeout: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds."""
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout)
    if proc.is_alive():
        logger.warning("Process %s (%d) did not exit in %.0f s; killing it", proc.name, proc.pid, timeout)
        proc.kill()
        proc.join(5)


def _close(proc: multiprocessing.process.BaseProcess | None, ctx: zmq.Context, timeout: float,
           addresses: tuple[str, ...]) -> None:
    if proc is not None:
        stop_process(proc, timeout)
    ctx.destroy(linger=0)
    _unlink(addresses)


@dataclass(frozen=True)
class CoreAddress:
    """Where a front end meets a core it did not start: the two ``ipc://`` addresses it binds
    (requests, outputs), its index among the core's clients and the core's pid (to watch it)."""

    input_address: str
    output_address: str
    client_index: int
    core_pid: int


@dataclass
class CoreProcess:
    """An engine core started for ``len(input_addresses)`` front ends; it exits when ``parent_end``
    closes (its starter exits, however)."""

    proc: multiprocessing.process.BaseProcess
    parent_end: Connection
    input_addresses: list[str]
    output_addresses: list[str]

    def address(self, client_index: int) -> CoreAddress:
        return CoreAddress(self.input_addresses[client_index], self.output_addresses[client_index], client_index,
                           self.proc.pid)


def start_core_process(config: EngineConfig, num_clients: int = 1,
                       addresses: tuple[str, str] | None = None) -> CoreProcess:
    """Spawn the engine core (CUDA does not survive a fork) for ``num_clients`` front ends, each with
    its own pair of fresh ``ipc://`` addresses (the front ends bind them; the core connects), or the
    one pair ``addresses`` for a single front end."""
    from kvserve.engine.core_proc import run_engine_core

    pairs = [addresses] if addresses is not None else [(_ipc_address(), _ipc_address()) for _ in range(num_clients)]
    inputs, outputs = [a for a, _ in pairs], [b for _, b in pairs]
    mp = multiprocessing.get_context("spawn")
    child_end, parent_end = mp.Pipe(duplex=False)
    proc = mp.Process(target=run_engine_core, name="EngineCore", args=(config, inputs, outputs, child_end))
    proc.start()
    child_end.close()
    return CoreProcess(proc, parent_end, inputs, outputs)


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, counts as gone)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")


class CoreClient:
    def __init__(self, config: EngineConfig, ready_timeout_s: float = READY_TIMEOUT_S,
                 address: CoreAddress | None = None) -> None:
        """Start a core for this client alone, or (``address``) attach to one the serve launcher
        started for several front ends."""
        self.ctx = zmq.Context()
        self.client_index = 0 if address is None else address.client_index
        if address is None:
            self.input_address, self.output_address = _ipc_address(), _ipc_address()
        else:
            self.input_address, self.output_address = address.input_address, address.output_address
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.bind(self.input_address)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(self.output_address)
        self.proc: multiprocessing.process.BaseProcess | None = None  # the core, if this client started it
        if address is None:
            core = start_core_process(config, addresses=(self.input_address, self.output_address))
            self.proc, self._parent_end = core.proc, core.parent_end
        self.core_pid = self.proc.pid if self.proc is not None else address.core_pid
        self._finalizer = weakref.finalize(self, _close, self.proc, self.ctx, 5.0,
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

    def _core_alive(self) -> bool:
        return self.proc.is_alive() if self.proc is not None else _pid_alive(self.core_pid)

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.output_socket.poll(100):
                out = self.decode(self.output_socket.recv())
                assert out.ready is not None, "the core's first message is its ready message"
                self.stats = out.stats
                return out.ready
            if not self._core_alive():
                code = self.proc.exitcode if self.proc is not None else None
                raise RuntimeError("Engine core initialization failed. See root cause above. "
                                   f"Failed core proc(s): {{'EngineCore': {code}}}")
        raise TimeoutError(
            "Timed out waiting for engine core processes to start. This is often caused by slow weight loading "
            f"for large models. Waited {timeout:.0f}s (configured by VLLM_ENGINE_READY_TIMEOUT_S). To increase "
            "the timeout, set the environment variable: VLLM_ENGINE_READY_TIMEOUT_S=<seconds>")

    def _watch(self) -> None:
        if self.proc is not None:
            wait_for([self.proc.sentinel])
            self.proc.join(1)  # reap it: its exit code
            code: int | None = self.proc.exitcode
        else:  # not our child: look every 100 ms (the launcher reaps it and stops this process too)
            while _pid_alive(self.core_pid) and not self._closing:
                time.sleep(0.1)
            code = None
        if self.dead is None and not self._closing:
            self.dead = f"engine core process exited with code {code}"
            logger.error("Engine core exited unexpectedly (exit code %s)", code)

    # ---- requests --------------------------------------------------------------------------
    def _send(self, kind: msg.RequestType, payload: Any) -> None:
        if self.dead is not None:
            raise EngineDeadError(_dead_text(self.dead))
        with self._lock:
            self.input_socket.send_multipart([kind.value, msg.ENCODER.encode(payload)])

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._send(msg.RequestType.ADD, msg.AddRequest(request_id, prompt_token_ids, params,
                                                       sorted(params.all_stop_token_ids), self.client_index))

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        if self.dead is None and request_ids:
            self._send(msg.RequestType.ABORT, msg.FinishRequests(list(request_ids), status, self.client_index))

    def call_utility(self, method: str, *args: Any) -> int:
        """Send a utility call; its answer comes among the outputs (``utility_call_id``)."""
        call_id = next(self._call_ids)
        self._send(msg.RequestType.UTILITY, msg.UtilityCall(call_id, method, list(args), self.client_index))
        return call_id

    # ---- outputs ---------------------------------------------------------------------------
    def dead_error(self) -> EngineDeadError:
        """The error for calls after the core is gone."""
        return EngineDeadError(_dead_text(self.dead or "the engine core is gone"))

    def decode(self, frame: bytes) -> msg.CoreOutputs:
        """One message of the core (``ENGINE_CORE_DEAD``: raises ``EngineDeadError``)."""
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
                out = self.decode(self.output_socket.recv())
                if out.stats is not None:
                    self.stats = out.stats
                return out
            if self.dead is not None:
                raise EngineDeadError(_dead_text(self.dead))
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the core this client started to stop, then make sure it did (an attached client only
        closes its sockets: the launcher stops the core); idempotent."""
        self._closing = True
        if self.proc is not None and self.proc.is_alive() and self.dead is None:
            try:
                with self._lock:
                    self.input_socket.send_multipart([msg.RequestType.SHUTDOWN.value, b""], flags=zmq.NOBLOCK)
                self.proc.join(timeout_s)
            except zmq.ZMQError:
                pass
        self.dead = self.dead or "shut down"
        self._finalizer()  # terminate / kill if still running, close the sockets
        if self.proc is not None:
            self._parent_end.close()
