"""``kvserve serve``: the FastAPI app (``build_app``) and its uvicorn runner, mirroring ``vllm serve``."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvserve
from kvserve.engine.async_llm import AsyncLLM, EngineDeadError
from kvserve.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, now
from kvserve.entrypoints.openai.serving import OpenAIError, OpenAIServing
from kvserve.logger import init_logger

logger = init_logger(__name__)


def _error(status: int, message: str, type: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(OpenAIError(message, status, type, param).body(), status_code=status)


def _validation_param(exc: RequestValidationError) -> str | None:
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if loc:
            return loc[0] if loc[0].isidentifier() else None
    return None


class ApiKeyMiddleware:
    """Bearer auth on /v1/* (vLLM: 401 {"error": "Unauthorized"}), compared in constant time."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and scope["path"].startswith("/v1"):
            given = b""
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    given = value
                    break
            if not hmac.compare_digest(given, self.expected):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(async_llm: AsyncLLM, served_model_name: str, api_key: str | None = None,
              default_sampling: dict[str, Any] | None = None) -> FastAPI:
    """The OpenAI-compatible app around a running ``AsyncLLM`` (one Prometheus registry per app);
    ``default_sampling``: request defaults, e.g. from ``generation_config_defaults``."""
    app = FastAPI(title="kvserve OpenAI-compatible server", version=kvserve.__version__)
    serving = OpenAIServing(async_llm, served_model_name, default_sampling)
    metrics = ServerMetrics(async_llm, served_model_name)
    async_llm.add_observer(metrics)
    app.state.async_llm, app.state.serving, app.state.metrics = async_llm, serving, metrics

    if api_key:
        # a plain ASGI middleware: BaseHTTPMiddleware (@app.middleware) would hide client
        # disconnects from request.is_disconnected()
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        msg = "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}" for e in errs[:5]
        ) or str(exc)
        return _error(400, msg, "BadRequestError", _validation_param(exc))

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "NotFoundError", 405: "MethodNotAllowed"}.get(exc.status_code, "BadRequestError")
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(503, str(exc), "ServiceUnavailableError")

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.error("Internal error while serving a request: %r", exc)
        return _error(500, str(exc) or type(exc).__name__, "InternalServerError")

    @app.get("/health")
    async def health() -> Response:
        if not async_llm.is_running:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": kvserve.__version__})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": now(), "owned_by": "kvserve",
            "root": str(async_llm.engine.config.model_config.model), "parent": None,
            "max_model_len": async_llm.max_model_len,
            "permission": [],
        }]})

    async def _respond(result: Any) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await _respond(await serving.create_completion(body, raw.is_disconnected))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await _respond(await serving.create_chat_completion(body, raw.is_disconnected))

    return app

