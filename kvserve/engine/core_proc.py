"""The engine core in its own process (vLLM v1's EngineCoreProc): a busy loop that never waits on
HTTP, fed and drained by two threads that move msgpack frames between ZeroMQ sockets and queues
(socket I/O and (de)serialization release the GIL while the loop steps).

Sockets: each front end (one, or ``--api-server-count`` of them) binds a PUSH (requests) and a PULL
(outputs) on ``ipc://`` paths; the core connects one PULL to every request socket (fair-queued) and
one PUSH to each output socket, and sends each front end the outputs of the requests it added
(vLLM routes the same way by client index). The first output to each is the ready message; a fatal
error sends ``ENGINE_CORE_DEAD`` to all and exits non-zero.
The core exits when its parent does (the end of a pipe the parent holds reads EOF), so a front end
killed hard leaves no engine behind."""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

import zmq

from kvserve.config import EngineConfig
from kvserve.engine import core_messages as msg
from kvserve.engine.core import EngineCore
from kvserve.logger import init_logger
from kvserve.process_name import set_process_name

logger = init_logger(__name__)

_STOP = object()  # the input queue's shutdown marker


class EngineCoreProc:
    """The loop around one ``EngineCore``; ``UTILITIES`` are the methods a front end may call."""

    UTILITIES = frozenset({"reset_prefix_cache", "scheduler_stats"})

    def __init__(self, config: EngineConfig, input_addresses: list[str], output_addresses: list[str]) -> None:
        self.core = EngineCore(config)
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()  # (client index, CoreOutputs), or a marker
        self.ctx = zmq.Context()
        self.output_sockets = []
        for address in output_addresses:  # one per front end, by client index
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 4000)  # the death notice gets out before exit
            sock.connect(address)
            self.output_sockets.append(sock)
        self.input_socket = self.ctx.socket(zmq.PULL)
        for address in input_addresses:
            self.input_socket.connect(address)
        self._client_of: dict[str, int] = {}  # live request id -> the front end that added it
        threading.Thread(target=self._read_inputs, name="kvserve-core-input", daemon=True).start()
        self._writer = threading.Thread(target=self._write_outputs, name="kvserve-core-output", daemon=True)
        self._writer.start()
        self._last_stats: msg.SchedulerStats | None = None
        mc, cc = config.model_config, config.cache_config
        ready = {"max_model_len": mc.max_model_len, "num_gpu_blocks": cc.num_blocks, "block_size": cc.block_size,
                 "pid": os.getpid()}
        for client in range(len(self.output_sockets)):
            self.output_queue.put((client, msg.CoreOutputs(stats=self.stats(), ready=ready)))

    # ---- threads ---------------------------------------------------------------------------
    def _read_inputs(self) -> None:
        while True:
            try:
                frames = self.input_socket.recv_multipart(copy=True)
            except zmq.ContextTerminated:
                return
            try:
                kind = msg.RequestType(frames[0])
                payload = None if kind == msg.RequestType.SHUTDOWN else msg.REQUEST_DECODERS[kind].decode(frames[1])
            except Exception as e:  # a bad frame must not kill the engine
                logger.exception("Undecodable request frame: %s", e)
                continue
            self.input_queue.put((kind, payload))
            if kind == msg.RequestType.SHUTDOWN:
                return

    def _write_outputs(self) -> None:
        buf = bytearray()
        while True:
            item = self.output_queue.get()
            if item is _STOP:
                return
            if item is msg.ENGINE_CORE_DEAD:
                for sock in self.output_sockets:
                    sock.send(msg.ENGINE_CORE_DEAD)
                return
            client, outputs = item
            msg.ENCODER.encode_into(outputs, buf)
            self.output_sockets[client].send(buf, copy=True)

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        core = self.core
        while True:
            block = not core.has_unfinished_requests()
            while True:
                try:
                    kind, payload = self.input_queue.get(block=block)
                except queue.Empty:
                    break
                block = False
                if kind == msg.RequestType.SHUTDOWN:
                    return
                self._handle(kind, payload)
            if core.has_unfinished_requests():
                self._step()
            else:  # aborts or stop-string finishes emptied it: the front end's stats follow
                self._send_stats()

    def _handle(self, kind: msg.RequestType, payload: Any) -> None:
        if kind == msg.RequestType.ADD:
            rid, client = payload.request_id, payload.client_index
            try:
                if rid in self._client_of:  # two front ends may be given the same id by their users
                    raise ValueError(f"Request id {rid!r} already exists.")
                self.core.add_request(rid, payload.prompt_token_ids, msg.params_of(payload))
            except Exception as e:  # refused: that request fails, the others keep running
                self.output_queue.put((client, msg.CoreOutputs(failed_request_ids=[rid], error=str(e))))
                return
            self._client_of[rid] = client
        elif kind == msg.RequestType.ABORT:
            ids = [r for r in payload.request_ids if self._client_of.get(r) == payload.client_index]
            for rid in ids:
                del self._client_of[rid]
            self.core.finish_requests(ids, payload.status)
        elif kind == msg.RequestType.UTILITY:
            out = msg.CoreOutputs(utility_call_id=payload.call_id)
            try:
                if payload.method not in self.UTILITIES:
                    raise ValueError(f"unknown utility {payload.method!r}; accepted: {sorted(self.UTILITIES)}")
                out.utility_result = getattr(self, payload.method)(*payload.args)
            except Exception as e:
                out.utility_error = f"Call to {payload.method} method failed: {e}"
            self.output_queue.put((payload.client_index, out))

    def _by_client(self, outputs: list, failed: list[str] = ()) -> dict[int, tuple[list, list[str]]]:
        """Outputs and failed ids per front end; finished requests leave the routing table."""
        routed: dict[int, tuple[list, list[str]]] = {}
        for out in outputs:
            client = self._client_of.get(out.request_id, 0)
            routed.setdefault(client, ([], []))[0].append(out)
            if out.finish_status is not None:
                self._client_of.pop(out.request_id, None)
        for rid in failed:
            routed.setdefault(self._client_of.pop(rid, 0), ([], []))[1].append(rid)
        return routed

    def _step(self) -> None:
        core = self.core
        try:
            outputs = core.step()
        except Exception as e:  # the core aborted the step's requests: tell their front ends
            logger.exception("Engine step failed; aborting the affected requests: %s", e)
            outputs, failed = core.take_failure()  # the step before the failed one still counts
            stats = self.stats()
            self._last_stats = stats
            routed = self._by_client(outputs, failed)
            for client in range(len(self.output_sockets)):
                outs, ids = routed.get(client, ([], []))
                self.output_queue.put((client, msg.CoreOutputs(outs, stats, ids, f"Engine step failed: {e}")))
            return
        self._send_stats(outputs)

    def _send_stats(self, outputs: list | None = None) -> None:
        """A step's outputs, to their front ends, with the scheduler's stats; the stats to every front
        end when they changed; nothing when neither did (a step whose requests all wait for room)."""
        stats = self.stats()
        changed = stats != self._last_stats
        self._last_stats = stats
        routed = self._by_client(outputs or [])
        for client in range(len(self.output_sockets)):
            outs, _ = routed.get(client, ([], []))
            if outs or changed:
                self.output_queue.put((client, msg.CoreOutputs(outs, stats)))

    # ---- utilities -------------------------------------------------------------------------
    def scheduler_stats(self) -> dict[str, int]:
        return self.core.stats()

    def stats(self) -> msg.SchedulerStats:
        return msg.SchedulerStats(**self.core.stats())

    def reset_prefix_cache(self) -> bool:
        return self.core.kv_manager.reset_prefix_cache()

    def close(self) -> None:
        self.output_queue.put(_STOP)
        self._writer.join(5)
        self.ctx.destroy(linger=0)


def _exit_with_parent(parent_end: Connection, addresses: tuple[str, ...]) -> None:
    """Block until the parent's end of the pipe closes (it exited, however), then leave at once,
    taking the ipc socket files a parent that died could not remove."""
    try:
        parent_end.recv()
    except (EOFError, OSError):
        pass
    for address in addresses:
        try:
            os.unlink(address.removeprefix("ipc://"))
        except OSError:
            pass
    os._exit(0)


def run_engine_core(config: EngineConfig, input_addresses: list[str], output_addresses: list[str],
                    parent_end: Connection) -> None:
    """The engine-core process (the spawn target); one input and one output address per front end."""
    set_process_name("EngineCore")
    threading.Thread(target=_exit_with_parent, args=(parent_end, (*input_addresses, *output_addresses)),
                     daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's: it shuts the core down
    proc = None
    try:
        proc = EngineCoreProc(config, input_addresses, output_addresses)
        proc.run()
    except BaseException as e:
        logger.error("EngineCore encountered a fatal error: %s\n%s", e, traceback.format_exc())
        if proc is None:  # failed to start: the front end sees the exit code
            raise SystemExit(1)
        proc.output_queue.put(msg.ENGINE_CORE_DEAD)
        proc._writer.join(5)
        raise SystemExit(1)
    proc.close()
    # asked to stop and done: leave without the interpreter's teardown (on the GPU it outlasted the
    # front end's 5 s grace more than once, which then killed the process; nothing is left to flush)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
