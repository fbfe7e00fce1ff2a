"""The HTTP server of ``fastinfer serve``: FastAPI routes on an :class:`~fastinfer.engine.async_llm.AsyncLLM`,
run by uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE streams), ``GET
/v1/models``, ``GET /health`` (200 while the engine runs, else 503), ``GET /metrics`` (Prometheus),
``POST /tokenize``, ``POST /detokenize``, ``GET /version``.

In front of every route a small ASGI guard reads the body up to ``max_body_bytes`` (413 beyond) and
checks ``Authorization: Bearer KEY`` on ``/v1/*`` when an API key is set (401). Every error, the
framework's own (404 route, 405 method) included, is OpenAI's JSON error shape; an unexpected one
is a 500 of that shape and the server keeps serving. SIGINT / SIGTERM: the engine stops, in-flight
streams end with an error event and ``[DONE]``, other requests with a 503, then uvicorn exits.
"""

from __future__ import annotations

import contextlib
import hmac
import importlib.metadata
import logging
import time
from typing import Optional

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.async_llm import AsyncLLM
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       error_body, parse_body)
from .serving import ServeLimits, until_disconnect
from .serving_chat import ServingChat
from .serving_completion import ServingCompletion

__all__ = ["build_app", "run_server"]

logger = logging.getLogger("fastinfer.serve")


def _error(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


class _Guard:
    """Body size limit and API key, before any route runs (pure ASGI: the body is read once here
    and replayed to the app; later ``receive`` calls reach the server, e.g. ``http.disconnect``)."""

    def __init__(self, app, max_body_bytes: int, api_key: Optional[str]):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"].startswith("/v1"):
            auth = headers.get("authorization", "")
            given = auth[7:] if auth[:7].lower() == "bearer " else None
            if given is None or not hmac.compare_digest(given.encode(), self.api_key.encode()):
                msg = ("Missing API key: send 'Authorization: Bearer KEY'" if given is None
                       else "Incorrect API key provided")
                return await _error(401, msg, code="invalid_api_key")(scope, receive, send)
        too_big = _error(413, f"the request body is larger than {self.max_body_bytes} bytes (--max-body-bytes)")
        try:
            if int(headers.get("content-length", "0")) > self.max_body_bytes:
                return await too_big(scope, receive, send)
        except ValueError:
            return await _error(400, "invalid Content-Length header")(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                return await too_big(scope, receive, send)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def build_app(engine: AsyncLLM, model_name: str, limits: Optional[ServeLimits] = None,
              api_key: Optional[str] = None, max_body_bytes: int = 4 << 20, model_root: Optional[str] = None,
              tool_call_parser: Optional[str] = None):
    """The ASGI app (FastAPI wrapped in the guard). ``tool_call_parser``: the format of the model's
    tool calls (see :mod:`.tool_parsers`); None refuses requests that need tool calls parsed."""
    limits = limits or ServeLimits()
    metrics = ServerMetrics(model_name, engine.stats)
    completion = ServingCompletion(engine, model_name, limits, metrics)
    chat = ServingChat(engine, model_name, limits, metrics, tool_call_parser=tool_call_parser)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_):
        engine.start()  # the engine thread hands outputs to this event loop
        yield

    app = FastAPI(title="fastinfer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        if request.url.path.startswith("/v1/"):
            metrics.rejected.inc()
        return _error(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        return _error(e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):
        logger.exception("unexpected error")
        return _error(500, f"internal error: {type(e).__name__}: {e}")

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return _error(503, f"the engine is not running: {engine.dead}", code="engine_dead")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        try:
            return {"version": importlib.metadata.version("fastinfer")}
        except importlib.metadata.PackageNotFoundError:
            return {"version": "unknown"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "fastinfer", "root": model_root or model_name,
                                            "parent": None, "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_body(CompletionRequest, await request.body())
        return await until_disconnect(request, completion.create(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_body(ChatCompletionRequest, await request.body())
        return await until_disconnect(request, chat.create(req))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse_body(TokenizeRequest, await request.body())
        completion.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            ids = chat.render(req.messages, req.add_generation_prompt)
        else:
            ids = completion.token_ids(req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse_body(DetokenizeRequest, await request.body())
        completion.check_model(req.model)
        ids = completion.token_ids(req.tokens, param="tokens")
        return {"prompt": completion.tokenizer.decode(ids) if completion.tokenizer is not None else ""}

    return _Guard(app, max_body_bytes, api_key)


def run_server(engine: AsyncLLM, app, host: str, port: int, log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM (see the module docstring)."""
    import asyncio

    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            loop = getattr(self, "_fastinfer_loop", None)
            if loop is not None and not self.should_exit:
                loop.call_soon_threadsafe(engine.shutdown)
            super().handle_exit(sig, frame)

        async def serve(self, sockets=None):
            self._fastinfer_loop = asyncio.get_running_loop()
            await super().serve(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            lifespan="on")
    # uvicorn re-raises the signal it stopped on once it is done; a no-op handler makes that a clean exit
    import signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    _Server(config).run()
    engine.shutdown()
