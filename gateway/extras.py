"""What tools probe beside the generation endpoints, as vLLM's server answers them.

GET /v1/models (and /v1/models/{id}) with `max_model_len`; POST /tokenize and
/detokenize (a worker of the model does it, so the ids are the ones Generate sees);
GET /version (every GET here also answers HEAD, as probes send it); and every path
FastAPI itself would answer (404, 405) in OpenAI's error shape rather than FastAPI's
`{"detail": ...}`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import metadata
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from clients.errors import KVCacheError
from clients.types import ChatMessage
from gateway.errors import ApiError, Status, from_daemon, invalid
from gateway.fleet import Fleet, Worker
from gateway.schema import parse_messages
from kvcache.v1 import generation_pb2

_HTTP_ERRORS = {
    404: Status(404, "invalid_request_error", "not_found"),
    405: Status(405, "invalid_request_error"),
}
MAX_DETOKENIZE_IDS = 1 << 20


def add_routes(app: FastAPI, fleet: Fleet, authenticate: Callable[[str | None], str]) -> None:
    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
        status = _HTTP_ERRORS.get(error.status_code, Status(error.status_code, "invalid_request_error"))
        detail = error.detail if isinstance(error.detail, str) else "request refused"
        message = f"{detail}: {request.method} {request.url.path}"
        return JSONResponse(ApiError(status, message).body(), status_code=error.status_code)

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version() -> JSONResponse:
        return JSONResponse({"version": _version()})

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def list_models(request: Request) -> JSONResponse:
        authenticate(request.headers.get("authorization"))
        models = fleet.models()
        return JSONResponse({"object": "list", "data": [model_card(m, models[m]) for m in sorted(models)]})

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def get_model(model: str, request: Request) -> JSONResponse:
        authenticate(request.headers.get("authorization"))
        return JSONResponse(model_card(model, fleet.workers_of(model)))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        authenticate(request.headers.get("authorization"))
        body = await _json(request)
        worker = _worker(fleet, body)
        call = _tokenize_request(body)
        reply = await _call(worker, worker.stub.Tokenize(call, timeout=fleet.config.route_timeout))
        ids = list(reply.token_ids)
        info = worker.info
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": info.max_model_len if info else None,
                "tokens": ids,
                "token_strs": None,
            }
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        authenticate(request.headers.get("authorization"))
        body = await _json(request)
        worker = _worker(fleet, body)
        tokens = body.get("tokens")
        ok = isinstance(tokens, list) and len(tokens) <= MAX_DETOKENIZE_IDS
        if not ok or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in tokens
        ):
            raise invalid("'tokens' must be a list of token ids (integers >= 0)", "tokens")
        call = generation_pb2.DetokenizeRequest(token_ids=tokens)
        detokenized = worker.stub.Detokenize(call, timeout=fleet.config.route_timeout)
        reply = await _call(worker, detokenized, {"token_ids": "tokens"})
        return JSONResponse({"prompt": reply.text})


def model_card(model: str, workers: list[Worker]) -> dict[str, Any]:
    """A model as vLLM's /v1/models lists it: the context length its workers accept."""
    lengths = [w.info.max_model_len for w in workers if w.info is not None]
    return {
        "id": model,
        "object": "model",
        "created": 0,
        "owned_by": "kvcache",
        "root": model,
        "parent": None,
        "max_model_len": min(lengths) if lengths else None,
        "permission": [],
    }


def _version() -> str:
    try:
        return metadata.version("kvcache")
    except metadata.PackageNotFoundError:
        return "0+unknown"


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise invalid("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def _worker(fleet: Fleet, body: dict[str, Any]) -> Worker:
    """The least loaded worker of the body's model (any model's when none is named)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("'model' must be a string", "model")
    if model is None:
        models = fleet.models()
        model = min(models) if models else ""
    workers = fleet.workers_of(model)
    return min(workers, key=lambda w: w.inflight)


def _tokenize_request(body: dict[str, Any]) -> generation_pb2.TokenizeRequest:
    known = {
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "add_generation_prompt",
        "return_token_strs",
    }
    for key, value in body.items():
        if key not in known and value is not None:
            raise invalid(f"'{key}' is not supported by /tokenize", key)
    if body.get("return_token_strs"):
        raise invalid("'return_token_strs' is not supported by this server", "return_token_strs")
    if body.get("add_generation_prompt") is False:
        raise invalid("chat messages are rendered with the generation prompt", "add_generation_prompt")
    prompt, messages = body.get("prompt"), body.get("messages")
    if prompt is None and messages is None:
        raise invalid("one of 'prompt' (a string) or 'messages' (a list of messages) is required", "prompt")
    if prompt is not None and messages is not None:
        raise invalid("give 'prompt' or 'messages', not both", "messages")
    if messages is not None:
        parsed: tuple[ChatMessage, ...] = parse_messages(messages)
        return generation_pb2.TokenizeRequest(messages=[m.to_proto() for m in parsed])
    if not isinstance(prompt, str):
        raise invalid("'prompt' must be a string", "prompt")
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise invalid("'add_special_tokens' must be true or false", "add_special_tokens")
    return generation_pb2.TokenizeRequest(text=prompt, add_special_tokens=add_special)


async def _call(worker: Worker, call: Any, fields: dict[str, str] | None = None) -> Any:
    """`call`'s reply; a refusal names `fields` (the worker's name -> the request's) as the request does."""
    try:
        return await call
    except grpc.RpcError as error:
        failure = KVCacheError.from_rpc_error("computed", worker.address, error)
        raise from_daemon(failure, fields) from None
