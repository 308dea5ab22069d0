"""The ``kvserve serve`` subcommand (mirrors ``vllm serve``). Torch- and FastAPI-free at import,
so building the ``kvserve`` parser stays fast; ``run`` imports the server lazily."""

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
    add_engine_args(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.config import EngineArgs
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.entrypoints.openai.api_server import build_app
    from kvserve.entrypoints.openai.serving import generation_config_defaults

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"model given twice: positional {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.skip_tokenizer_init:
        raise ValueError(
            "kvserve serve needs a tokenizer (chat templates, text prompts, decoded logprobs): "
            "--skip-tokenizer-init is only supported offline (LLM, kvserve bench throughput)."
        )
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or os.environ.get("KVSERVE_API_KEY")
    # the engine core in its own process (vLLM v1); VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps it in this one
    multiprocess = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
    async_llm = AsyncLLM.from_engine_args(EngineArgs(**engine_kwargs(args)), multiprocess=multiprocess)
    name = args.served_model_name or args.model or str(async_llm.engine.config.model_config.model)
    defaults = generation_config_defaults(str(async_llm.engine.config.model_config.model), args.generation_config)
    app = build_app(async_llm, name, api_key, defaults)
    logger.info("Serving model %s on http://%s:%d", name, args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level))
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
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled (uvicorn.run swallows it too)
        pass
    finally:
        async_llm.shutdown()
    return 1 if died.is_set() else 0
