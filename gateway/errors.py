"""The gateway's errors in OpenAI's JSON shape, and the one table mapping gRPC codes to them.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

`ApiError` is what every layer raises; `from_daemon` turns a daemon's failure
(`clients.errors.KVCacheError`) into one through `GRPC_STATUS`. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from clients.errors import KVCacheError


@dataclass(frozen=True)
class Status:
    """An HTTP status and the OpenAI error type (and code) that go with it."""

    http: int
    type: str
    code: str | None = None


INVALID = Status(400, "invalid_request_error")
UNAUTHORIZED = Status(401, "authentication_error", "invalid_api_key")
FORBIDDEN = Status(403, "permission_error")
NOT_FOUND = Status(404, "invalid_request_error", "model_not_found")
RATE_LIMITED = Status(429, "rate_limit_error", "rate_limit_exceeded")
INTERNAL = Status(500, "server_error")
UNAVAILABLE = Status(503, "server_error", "service_unavailable")
TIMEOUT = Status(504, "timeout", "deadline_exceeded")

# The one mapping of the daemons' gRPC status codes to what an OpenAI client sees.
GRPC_STATUS: dict[grpc.StatusCode, Status] = {
    grpc.StatusCode.INVALID_ARGUMENT: INVALID,
    grpc.StatusCode.OUT_OF_RANGE: INVALID,
    grpc.StatusCode.FAILED_PRECONDITION: Status(503, "server_error", "worker_resyncing"),
    grpc.StatusCode.NOT_FOUND: NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED: Status(502, "server_error", "upstream_unauthenticated"),
    grpc.StatusCode.PERMISSION_DENIED: Status(502, "server_error", "upstream_permission_denied"),
    # computed answers RESOURCE_EXHAUSTED when its pool could not hold the request even
    # empty (DESIGN.md, Errors): retrying cannot help, so it is the caller's 400, not a 429.
    grpc.StatusCode.RESOURCE_EXHAUSTED: Status(400, "invalid_request_error", "request_too_large"),
    grpc.StatusCode.UNAVAILABLE: UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: TIMEOUT,
    grpc.StatusCode.CANCELLED: Status(499, "server_error", "cancelled"),
    grpc.StatusCode.ABORTED: UNAVAILABLE,
    grpc.StatusCode.ALREADY_EXISTS: Status(409, "invalid_request_error", "conflict"),
    grpc.StatusCode.UNIMPLEMENTED: Status(502, "server_error", "upstream_unimplemented"),
    grpc.StatusCode.INTERNAL: INTERNAL,
    grpc.StatusCode.UNKNOWN: INTERNAL,
    grpc.StatusCode.DATA_LOSS: INTERNAL,
}


class ApiError(Exception):
    """A request failed: answered as `status.http` with OpenAI's error body."""

    def __init__(self, status: Status, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.status.type,
                "param": self.param,
                "code": self.status.code,
            }
        }


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(INVALID, message, param)


def unsupported(param: str, why: str = "") -> ApiError:
    tail = f": {why}" if why else ""
    return ApiError(INVALID, f"'{param}' is not supported by this server{tail}", param)


def from_daemon(error: KVCacheError, fields: Mapping[str, str] | None = None) -> ApiError:
    """A daemon's failure as the client's error; bad input keeps the daemon's own words, its
    field names said as the request's (`fields`: the worker's name -> the request's) and
    the field it names first as the error's `param`."""
    status = GRPC_STATUS.get(error.code, INTERNAL)
    if status.http == 400:
        message, param = in_request_words(error.details or str(error), fields or {})
        return ApiError(status, message, param)
    return ApiError(status, str(error))


# Worker fields whose name the HTTP request shares (computed's GenerateRequest and vLLM's API).
SAME_NAMED_FIELDS = (
    "stop_token_ids",
    "logit_bias",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "request_id",
)
# Worker field names renamed in a message (the others read right as they are).
_RENAMED = re.compile(r"\b(prompt_token_ids|token_ids|max_tokens)\b")
_LEADING_FIELD = re.compile(r"(\w+)(?::| must | is over )")


def in_request_words(message: str, fields: Mapping[str, str]) -> tuple[str, str | None]:
    """A worker's refusal with its field names as the request's, and the field at fault.

    The field at fault is the one the message leads with ("logit_bias: ...", "top_p must
    be ..."), else max_tokens where it is named ("prompt has N tokens and max_tokens is
    M, ..."), else the prompt where the message is about it ("prompt has N tokens but
    ..."); None when `fields` does not know it.
    """
    lead = _LEADING_FIELD.match(message)
    if lead is not None and lead.group(1) in fields:
        param: str | None = fields[lead.group(1)]
    elif re.search(r"\bmax_tokens\b", message) and "max_tokens" in fields:
        param = fields["max_tokens"]
    elif message.startswith("prompt ") and "prompt" in fields:
        param = fields["prompt"]
    else:
        param = None
    renamed = _RENAMED.sub(lambda m: fields.get(m.group(1), m.group(1)), message)
    return renamed, param
