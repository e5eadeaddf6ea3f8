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
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from types import MappingProxyType
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from clients.types import GenerateChunk, Usage
from gateway import extras, metrics
from gateway.config import GatewayConfig
from gateway.errors import INTERNAL, SAME_NAMED_FIELDS, UNAUTHORIZED, ApiError, invalid
from gateway.fleet import Fleet
from gateway.generation import Generation
from gateway.responses import DONE, ChoiceOutput, Reply, finish_reason, sse, usage_body
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

    # FastAPI's answers are counted by GenerationEndpoints (by route template), not here.
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return _error_response(request.url.path, error, count=False)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error", path=request.url.path)
        error = ApiError(INTERNAL, f"internal error: {type(error).__name__}")
        return _error_response(request.url.path, error, count=False)

    # Probes answer HEAD as GET does (status and headers, no body).
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        models = fleet.models()
        up = sum(len(w) for w in models.values())
        body = {"status": "ok" if up else "no_workers", "workers_up": up, "workers": len(fleet.workers)}
        return JSONResponse({**body, "models": sorted(models)}, status_code=200 if up else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    extras.add_routes(app, fleet, lambda authorization: _authenticate(tenants, authorization))

    # Served by GenerationEndpoints before FastAPI; the routes keep 405s and the route table as they were.
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        headers = request.headers
        return await _serve(
            "chat", headers.get("authorization"), headers.get("x-request-id"), await request.body()
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        headers = request.headers
        return await _serve(
            "completion", headers.get("authorization"), headers.get("x-request-id"), await request.body()
        )

    async def _serve(
        endpoint: str, authorization: str | None, request_id: str | None, raw: bytes
    ) -> Response:
        received = time.monotonic()
        tenant = _authenticate(tenants, authorization)
        parse = parse_chat if endpoint == "chat" else parse_completion
        try:
            body = json.loads(raw)
        except ValueError:
            raise invalid("the request body is not valid JSON") from None
        req = parse(body)
        fields = worker_fields(req.kind, body)
        scope = tenants.scope(tenant)
        reply = Reply.new(endpoint, req.model)
        request_id = req.request_id or request_id or reply.id
        # The workers echo the id in every message and refuse one over 256 characters: a
        # longer one is echoed to the client only.
        worker_id = request_id if len(request_id) <= MAX_WORKER_REQUEST_ID else reply.id
        many = len(req.prompts) * req.n > 1
        generations = [
            Generation(
                fleet,
                req.model,
                dataclasses.replace(
                    prompt,
                    cache_salt=scope.cache_salt,
                    public_prefix_tokens=scope.public_prefix_tokens,
                    request_id=f"{worker_id}-{i * req.n + j}" if many else worker_id,
                ),
                req.sampling_for(j),
                fields,
            )
            for i, prompt in enumerate(req.prompts)
            for j in range(req.n)
        ]
        await _start_all(generations)
        metrics.FIRST_CHUNK.observe(time.monotonic() - received)
        headers = {"x-request-id": request_id, WORKER_HEADER: _workers(generations)}
        if req.stream:
            events = _events(reply, req, generations)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={**_SSE_HEADERS, **headers}
            )
        return JSONResponse(await _collect(reply, req, generations), headers=headers)

    # Outside FastAPI: the hot path skips its middleware stack and routing (about a fifth of
    # the gateway's time per request when it ran inside), and answers its own errors.
    return GenerationEndpoints(app, serve=_serve)


class GenerationEndpoints:
    """POST /v1/chat/completions and /v1/completions as plain ASGI (the hot path); the rest
    (other paths and methods, lifespan) passes on to `app`, each answer counted in
    gateway_requests_total by its route's template ("unmatched" when no route matches), so
    that ids in paths (/v1/models/{model}) do not each add a series."""

    def __init__(
        self, app: ASGIApp, serve: Callable[[str, str | None, str | None, bytes], Awaitable[Response]]
    ) -> None:
        self.app = app
        self.serve = serve

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if path not in _ENDPOINTS or scope["method"] != "POST":
            await _counted(self.app, scope, receive, _echo_request_id(scope, send))
            return
        request_id = _header(scope, b"x-request-id")
        try:
            response = await self.serve(
                _ENDPOINTS[path], _header(scope, b"authorization"), request_id, await _body(receive)
            )
        except ApiError as error:
            response = _error_response(path, error, request_id)
        except Exception as error:  # answered in OpenAI's shape, as the app's handler does
            log.exception("unexpected error", path=path)
            error = ApiError(INTERNAL, f"internal error: {type(error).__name__}")
            response = _error_response(path, error, request_id)
        await response(scope, receive, send)


async def _counted(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """`app` serves the request; its status is counted under the matched route's template."""
    status = "500"

    async def sending(message: Any) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = str(message["status"])
        await send(message)

    try:
        await app(scope, receive, sending)
    finally:
        metrics.REQUESTS.labels(route_label(scope), status).inc()


def route_label(scope: Scope) -> str:
    """The template of the route that served `scope` (/v1/models/{model}); "unmatched" for none."""
    route = scope.get("route")
    template = getattr(route, "path_format", None) or getattr(route, "path", None)
    return template if isinstance(template, str) and template else UNMATCHED


UNMATCHED = "unmatched"


def _field_names(prompt: str, max_name: str) -> Mapping[str, str]:
    same = {name: name for name in SAME_NAMED_FIELDS}
    return MappingProxyType({**same, "prompt_token_ids": prompt, "prompt": prompt, "max_tokens": max_name})


# The three ways a request names the worker's fields, built once (not per request).
_COMPLETION_FIELDS = _field_names("prompt", "max_tokens")
_CHAT_FIELDS = _field_names("messages", "max_tokens")
_CHAT_COMPLETION_TOKENS_FIELDS = _field_names("messages", "max_completion_tokens")


def worker_fields(kind: str, body: dict[str, Any]) -> Mapping[str, str]:
    """The worker's field names -> the request's, to say a worker's refusal in the client's
    words (gateway.errors.from_daemon)."""
    if kind != "chat":
        return _COMPLETION_FIELDS
    return _CHAT_COMPLETION_TOKENS_FIELDS if body.get("max_completion_tokens") is not None else _CHAT_FIELDS


def _echo_request_id(scope: Scope, send: Send) -> Send:
    """`send` that adds the request's x-request-id (when it has one) to the response."""
    if scope["type"] != "http":
        return send
    request_id = _header(scope, b"x-request-id")
    if request_id is None:
        return send

    async def sending(message: Any) -> None:
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
            message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode("latin-1"))]}
        await send(message)

    return sending


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
# Names the worker(s) that served a generation (comma-separated when n or prompts > 1).
WORKER_HEADER = "x-kvcache-worker"
MAX_WORKER_REQUEST_ID = 240  # computed's limit is 256, with room for a "-choice" suffix


def _workers(generations: Sequence[Generation]) -> str:
    addresses = dict.fromkeys(g.worker.address for g in generations if g.worker is not None)
    return ",".join(addresses)


def _authenticate(tenants: Tenants, authorization: str | None) -> str:
    tenant = tenants.authenticate(authorization)
    if tenant is None:
        raise ApiError(UNAUTHORIZED, "Incorrect or missing API key: send 'Authorization: Bearer <key>'")
    return tenant


def _error_response(
    path: str, error: ApiError, request_id: str | None = None, count: bool = True
) -> JSONResponse:
    if count:  # the hot path's own paths (two, fixed); FastAPI's are counted by _counted
        metrics.REQUESTS.labels(path, str(error.status.http)).inc()
    if error.status.http >= 500:
        log.warning("request failed", path=path, status=error.status.http, error=error.message)
    headers = {"x-request-id": request_id} if request_id is not None else None
    return JSONResponse(error.body(), status_code=error.status.http, headers=headers)


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
    outputs = _outputs(req)
    metrics.INFLIGHT.inc()
    finished = False
    try:
        async for index, chunk in _merged(generations):
            reason = finish_reason(chunk.finish_reason) if chunk.finish_reason else None
            if chunk.usage is not None:
                usages[index] = chunk.usage
            text, logprobs = chunk.text, None
            if outputs is not None:
                prefix, logprobs = outputs[index].take(chunk.logprobs, chunk.prompt_logprobs)
                text = prefix + text
            if text or reason or not started[index] or chunk.logprobs:
                first = reply.kind == "chat" and not started[index]
                yield reply.chunk_event(
                    index, text, reason, first=first, with_usage=req.include_usage, logprobs=logprobs
                )
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
    outputs = _outputs(req)

    async def one(index: int, generation: Generation) -> tuple[str, str, Usage | None, Any]:
        texts, reason, usage, blocks = [], "", None, []
        async for chunk in generation.chunks():
            if outputs is not None:
                prefix, block = outputs[index].take(chunk.logprobs, chunk.prompt_logprobs)
                texts.append(prefix)
                blocks.append(block)
            texts.append(chunk.text)
            if chunk.finish_reason:
                reason, usage = chunk.finish_reason, chunk.usage
        logprobs = outputs[index].merge(blocks) if outputs is not None else None
        return "".join(texts), reason, usage, logprobs

    metrics.INFLIGHT.inc()
    try:
        results = await asyncio.gather(*(one(i, g) for i, g in enumerate(generations)))
    finally:
        metrics.INFLIGHT.dec()
        for g in generations:
            g.close()
    usages = [u for _, _, u, _ in results]
    usage = usage_body(usages, req.n)
    _count(reply.kind, usages, usage, "200")
    logprobs = [lp for _, _, _, lp in results] if outputs is not None else None
    return reply.body([t for t, _, _, _ in results], [r for _, r, _, _ in results], usage, logprobs)


def _outputs(req: GenerationRequest) -> list[ChoiceOutput] | None:
    """Each choice's echo and logprobs state; None when the request asked for neither."""
    if req.logprobs is None and not req.echo:
        return None
    return [
        ChoiceOutput(req.kind, req.logprobs, req.echo, prompt.text)
        for prompt in req.prompts
        for _ in range(req.n)
    ]


def _count(kind: str, usages: Sequence[Usage | None], usage: dict[str, Any], status: str) -> None:
    metrics.REQUESTS.labels(_PATHS[kind], status).inc()
    metrics.TOKENS.labels("prompt").inc(usage["prompt_tokens"])
    metrics.TOKENS.labels("cached").inc(usage["prompt_tokens_details"]["cached_tokens"])
    metrics.TOKENS.labels("completion").inc(usage["completion_tokens"])
    for u in usages:
        if u is not None:
            metrics.TTFT.observe(u.time_to_first_token_seconds)
