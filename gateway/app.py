"""The HTTP surface: OpenAI's endpoints on FastAPI, each a thin adapter.

Body in -> `gateway.schema` (pure validation) -> tenant's cache scope
(`gateway.tenants`) -> one `Generation` per (prompt, sample) -> `gateway.responses`
(OpenAI's bodies and stream chunks) out. Every failure is an `ApiError` answered in
OpenAI's error shape; a streaming client that goes away cancels its generations.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from clients.types import GenerateChunk, Usage
from gateway import metrics
from gateway.config import GatewayConfig
from gateway.errors import INTERNAL, UNAUTHORIZED, ApiError, invalid
from gateway.fleet import Fleet
from gateway.generation import Generation
from gateway.responses import DONE, Reply, finish_reason, sse, usage_body
from gateway.schema import GenerationRequest, parse_chat, parse_completion
from gateway.tenants import Tenants

log = structlog.get_logger("gateway")


def build_app(config: GatewayConfig, fleet: Fleet | None = None, tenants: Tenants | None = None) -> ASGIApp:
    """The gateway's ASGI app: the generation endpoints first, FastAPI for everything else."""
    fleet = fleet or Fleet(config)
    tenants = tenants or Tenants(config.api_keys, config.public_prefix_tokens)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await fleet.start()
        yield
        await fleet.close()

    app = FastAPI(title="kvcache gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.fleet = fleet

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return _error_response(request.url.path, error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error", path=request.url.path)
        return _error_response(
            request.url.path, ApiError(INTERNAL, f"internal error: {type(error).__name__}")
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        models = fleet.models()
        up = sum(len(w) for w in models.values())
        body = {"status": "ok" if up else "no_workers", "workers_up": up, "workers": len(fleet.workers)}
        return JSONResponse({**body, "models": sorted(models)}, status_code=200 if up else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        _authenticate(tenants, request.headers.get("authorization"))
        return JSONResponse({"object": "list", "data": [_model(m) for m in sorted(fleet.models())]})

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> JSONResponse:
        _authenticate(tenants, request.headers.get("authorization"))
        fleet.workers_of(model)
        return JSONResponse(_model(model))

    # Served by GenerationEndpoints before FastAPI; the routes keep 405s and the route table as they were.
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _serve("chat", request.headers.get("authorization"), await request.body())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve("completion", request.headers.get("authorization"), await request.body())

    async def _serve(endpoint: str, authorization: str | None, raw: bytes) -> Response:
        tenant = _authenticate(tenants, authorization)
        parse = parse_chat if endpoint == "chat" else parse_completion
        try:
            body = json.loads(raw)
        except ValueError:
            raise invalid("the request body is not valid JSON") from None
        req = parse(body)
        scope = tenants.scope(tenant)
        generations = [
            Generation(
                fleet,
                req.model,
                dataclasses.replace(
                    prompt, cache_salt=scope.cache_salt, public_prefix_tokens=scope.public_prefix_tokens
                ),
                req.sampling_for(j),
            )
            for prompt in req.prompts
            for j in range(req.n)
        ]
        await _start_all(generations)
        reply = Reply.new(endpoint, req.model)
        if req.stream:
            events = _events(reply, req, generations)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        return JSONResponse(await _collect(reply, req, generations))

    # Outside FastAPI: the hot path skips its middleware stack and routing (about a fifth of
    # the gateway's time per request when it ran inside), and answers its own errors.
    return GenerationEndpoints(app, serve=_serve)


class GenerationEndpoints:
    """POST /v1/chat/completions and /v1/completions as plain ASGI (the hot path); the rest
    (other paths and methods, lifespan) passes on to `app`."""

    def __init__(self, app: ASGIApp, serve: Callable[[str, str | None, bytes], Awaitable[Response]]) -> None:
        self.app = app
        self.serve = serve

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or path not in _ENDPOINTS or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            response = await self.serve(
                _ENDPOINTS[path], _header(scope, b"authorization"), await _body(receive)
            )
        except ApiError as error:
            response = _error_response(path, error)
        except Exception as error:  # answered in OpenAI's shape, as the app's handler does
            log.exception("unexpected error", path=path)
            response = _error_response(path, ApiError(INTERNAL, f"internal error: {type(error).__name__}"))
        await response(scope, receive, send)


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise invalid("the client went away before sending its body")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
_ENDPOINTS = {path: kind for kind, path in _PATHS.items()}
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _model(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "kvcache"}


def _authenticate(tenants: Tenants, authorization: str | None) -> str:
    tenant = tenants.authenticate(authorization)
    if tenant is None:
        raise ApiError(UNAUTHORIZED, "Incorrect or missing API key: send 'Authorization: Bearer <key>'")
    return tenant


def _error_response(path: str, error: ApiError) -> JSONResponse:
    metrics.REQUESTS.labels(path, str(error.status.http)).inc()
    if error.status.http >= 500:
        log.warning("request failed", path=path, status=error.status.http, error=error.message)
    return JSONResponse(error.body(), status_code=error.status.http)


async def _start_all(generations: Sequence[Generation]) -> None:
    """Open every stream up to its first message; on any failure close them all and raise it."""
    if len(generations) == 1:
        await generations[0].start()
        return
    results = await asyncio.gather(*(g.start() for g in generations), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for g in generations:
            g.close()
        raise errors[0]


async def _merged(generations: Sequence[Generation]) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """(choice index, chunk) from every generation as they come; the first failure is raised."""
    if len(generations) == 1:
        async for chunk in generations[0].chunks():
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, GenerateChunk | None, ApiError | None]] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for chunk in generation.chunks():
                queue.put_nowait((index, chunk, None))
            queue.put_nowait((index, None, None))
        except ApiError as error:
            queue.put_nowait((index, None, error))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            index, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                running -= 1
            else:
                yield index, chunk
    finally:
        for task in tasks:
            task.cancel()
        for g in generations:
            g.close()


async def _events(
    reply: Reply, req: GenerationRequest, generations: Sequence[Generation]
) -> AsyncIterator[bytes]:
    usages: list[Usage | None] = [None] * len(generations)
    started = [False] * len(generations)
    metrics.INFLIGHT.inc()
    finished = False
    try:
        async for index, chunk in _merged(generations):
            reason = finish_reason(chunk.finish_reason) if chunk.finish_reason else None
            if chunk.usage is not None:
                usages[index] = chunk.usage
            if chunk.text or reason or not started[index]:
                first = reply.kind == "chat" and not started[index]
                yield sse(reply.chunk(index, chunk.text, reason, first=first, with_usage=req.include_usage))
                started[index] = True
        usage = usage_body(usages, req.n)
        if req.include_usage:
            yield sse(reply.usage_chunk(usage))
        yield DONE
        finished = True
        _count(reply.kind, usages, usage, "200")
    except ApiError as error:
        finished = True
        metrics.REQUESTS.labels(_PATHS[reply.kind], str(error.status.http)).inc()
        yield sse(error.body())
    finally:
        metrics.INFLIGHT.dec()
        if not finished:
            metrics.DISCONNECTS.inc()
            for g in generations:
                g.close()


async def _collect(reply: Reply, req: GenerationRequest, generations: Sequence[Generation]) -> dict[str, Any]:
    async def one(generation: Generation) -> tuple[str, str, Usage | None]:
        texts, reason, usage = [], "", None
        async for chunk in generation.chunks():
            texts.append(chunk.text)
            if chunk.finish_reason:
                reason, usage = chunk.finish_reason, chunk.usage
        return "".join(texts), reason, usage

    metrics.INFLIGHT.inc()
    try:
        results = await asyncio.gather(*(one(g) for g in generations))
    finally:
        metrics.INFLIGHT.dec()
        for g in generations:
            g.close()
    usages = [u for _, _, u in results]
    usage = usage_body(usages, req.n)
    _count(reply.kind, usages, usage, "200")
    return reply.body([t for t, _, _ in results], [r for _, r, _ in results], usage)


def _count(kind: str, usages: Sequence[Usage | None], usage: dict[str, Any], status: str) -> None:
    metrics.REQUESTS.labels(_PATHS[kind], status).inc()
    metrics.TOKENS.labels("prompt").inc(usage["prompt_tokens"])
    metrics.TOKENS.labels("cached").inc(usage["prompt_tokens_details"]["cached_tokens"])
    metrics.TOKENS.labels("completion").inc(usage["completion_tokens"])
    for u in usages:
        if u is not None:
            metrics.TTFT.observe(u.time_to_first_token_seconds)
