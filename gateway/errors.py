"""The gateway's errors in OpenAI's JSON shape, and the one table mapping gRPC codes to them.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

`ApiError` is what every layer raises; `from_daemon` turns a daemon's failure
(`clients.errors.KVCacheError`) into one through `GRPC_STATUS`. Pure: no I/O.
"""

from __future__ import annotations

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


def from_daemon(error: KVCacheError) -> ApiError:
    """A daemon's failure as the client's error; bad input keeps the daemon's own words."""
    status = GRPC_STATUS.get(error.code, INTERNAL)
    if status.http == 400:
        return ApiError(status, error.details or str(error))
    return ApiError(status, str(error))
