"""The ``kvserve serve`` subcommand (mirrors ``vllm serve``). Torch- and FastAPI-free at import,
so building the ``kvserve`` parser stays fast; ``run`` imports the server lazily.

One API server (the default): this process serves HTTP and starts the engine core in its own
process. ``--api-server-count N`` (N > 1, vLLM's flag): this process binds the listening socket,
starts the engine core for N front ends and N API server processes (``ApiServer_<i>``) that share
the socket (the kernel hands each connection to one of them) and their Prometheus counters (a
multiprocess directory), then watches them all: one that fails takes the others down (exit 1)."""

from __future__ import annotations

import argparse
import os
import threading
import time
from typing import Any

from kvserve.arg_utils import add_engine_args, engine_kwargs
from kvserve.logger import init_logger

logger = init_logger(__name__)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible HTTP server (like `vllm serve`)")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="local HF checkpoint folder (same as --model; default: SmolLM2-135M-Instruct)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (env VLLM_API_KEY or KVSERVE_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="model name in the API (default: the model path)")
    g.add_argument("--generation-config", default="auto",
                   help="default sampling params: 'auto' (the model's generation_config.json), a folder, or 'vllm' (none)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="Disable uvicorn access log.")
    g.add_argument("--api-server-count", "-asc", type=int, default=1,
                   help="How many API server processes to run.")
    add_engine_args(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from kvserve.config import EngineArgs
    from kvserve.engine.async_llm import AsyncLLM

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"model given twice: positional {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.skip_tokenizer_init:
        raise ValueError(
            "kvserve serve needs a tokenizer (chat templates, text prompts, decoded logprobs): "
            "--skip-tokenizer-init is only supported offline (LLM, kvserve bench throughput)."
        )
    # the engine core in its own process (vLLM v1); VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps it in this one
    multiprocess = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
    count = args.api_server_count
    if count < 1:
        raise ValueError(f"--api-server-count={count}: kvserve has no headless mode (engine cores without an "
                         "API server, vLLM's for multi-node data parallelism); accepted: an integer >= 1")
    if count > 1 and not multiprocess:
        raise ValueError(f"--api-server-count={count} needs the engine core in its own process: unset "
                         "VLLM_ENABLE_V1_MULTIPROCESSING=0")
    if count > 1:
        return run_multi_api_server(args, count)
    async_llm = AsyncLLM.from_engine_args(EngineArgs(**engine_kwargs(args)), multiprocess=multiprocess)
    return _serve(args, async_llm)


def _serve(args: argparse.Namespace, async_llm: Any, sock: Any = None) -> int:
    """Serve HTTP over ``async_llm`` until Ctrl-C / SIGTERM (0) or the engine's death (1); on the
    listening socket ``sock`` (an API server of several) or on --host / --port."""
    import uvicorn

    from kvserve.entrypoints.openai.api_server import build_app
    from kvserve.entrypoints.openai.serving import generation_config_defaults

    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or os.environ.get("KVSERVE_API_KEY")
    name = args.served_model_name or args.model or str(async_llm.engine.config.model_config.model)
    defaults = generation_config_defaults(str(async_llm.engine.config.model_config.model), args.generation_config)
    app = build_app(async_llm, name, api_key, defaults)
    logger.info("Serving model %s on http://%s:%d", name, args.host, args.port)
    # vLLM's uvicorn settings: the access log unless --disable-uvicorn-access-log, keep-alive
    # VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds (5)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=int(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5"))))
    died = threading.Event()

    def watchdog() -> None:  # vLLM's: a dead engine stops the server (VLLM_WATCHDOG_TIME_S)
        period = float(os.environ.get("VLLM_WATCHDOG_TIME_S", "5.0"))
        while not server.should_exit:
            time.sleep(period)
            if not async_llm.is_running and not server.should_exit:
                logger.error("The engine is dead; shutting down the API server.")
                died.set()
                server.should_exit = True

    threading.Thread(target=watchdog, name="kvserve-watchdog", daemon=True).start()
    try:
        server.run(sockets=None if sock is None else [sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled (uvicorn.run swallows it too)
        pass
    finally:
        async_llm.shutdown()
    return 1 if died.is_set() else 0


def _server_socket(host: str, port: int) -> Any:
    """The listening socket, bound here before the engine starts (as vLLM does) and shared by the API
    server processes."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_api_server_worker(args: argparse.Namespace, sock: Any, config: Any, address: Any) -> None:
    """An API server process of several (the spawn target): its front end attached to the shared core."""
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.engine.engine import Engine

    from kvserve.process_name import set_process_name

    set_process_name(f"ApiServer_{address.client_index}")
    logger.info("Starting API server %d", address.client_index)
    raise SystemExit(_serve(args, AsyncLLM(Engine(config, multiprocess=True, core_address=address)), sock))


def run_multi_api_server(args: argparse.Namespace, count: int) -> int:
    """``--api-server-count`` > 1: the engine core and ``count`` API server processes, watched until
    Ctrl-C / SIGTERM (0) or until one of them fails (1); every process is gone on return."""
    import multiprocessing
    import signal
    import tempfile
    from multiprocessing.connection import wait

    from kvserve.config import EngineArgs
    from kvserve.engine.core_client import start_core_process, stop_process

    prometheus_dir = None
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        logger.warning("Found PROMETHEUS_MULTIPROC_DIR was set by user. This directory must be wiped between vLLM "
                       "runs or you will find inaccurate metrics. Unset the variable and vLLM will properly handle "
                       "cleanup.")
    else:  # the API servers' counters meet here; any server's /metrics sums them (vLLM's setup)
        prometheus_dir = tempfile.TemporaryDirectory(prefix="kvserve-prometheus-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = prometheus_dir.name

    def on_sigterm(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    sock = _server_socket(args.host, args.port)
    config = EngineArgs(**engine_kwargs(args)).create_engine_config()
    core = start_core_process(config, count)
    mp = multiprocessing.get_context("spawn")
    servers = [mp.Process(target=run_api_server_worker, name=f"ApiServer_{i}",
                          args=(args, sock, config, core.address(i))) for i in range(count)]
    code = 0
    try:
        for p in servers:
            p.start()
        logger.info("Started %d API server processes", count)
        watched = {p.sentinel: p for p in servers}
        while watched:
            ready = wait([*watched, core.proc.sentinel])
            if core.proc.sentinel in ready:
                core.proc.join(1)
                logger.error("Engine core process %s (PID: %d) died unexpectedly with exit code %s.",
                             core.proc.name, core.proc.pid, core.proc.exitcode)
                code = 1
                break
            failed = [watched.pop(s) for s in ready]
            for p in failed:
                p.join(1)  # reap it: its exit code
            bad = [p for p in failed if p.exitcode != 0]
            if bad:
                logger.error("Process %s (PID: %d) died with exit code %s", bad[0].name, bad[0].pid, bad[0].exitcode)
                code = 1
                break
    except KeyboardInterrupt:
        logger.info("Received KeyboardInterrupt, shutting down API servers...")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for p in servers:
            if p.is_alive():
                p.terminate()
        for p in servers:
            if p.pid is not None:
                stop_process(p, 10.0)
        core.parent_end.close()  # the core exits when its parent's end of the pipe closes
        stop_process(core.proc, 5.0)
        for address in (*core.input_addresses, *core.output_addresses):
            try:  # a server killed hard leaves its bound ipc files
                os.unlink(address.removeprefix("ipc://"))
            except OSError:
                pass
        sock.close()
        if prometheus_dir is not None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            prometheus_dir.cleanup()
    return code
