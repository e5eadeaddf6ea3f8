"""The one error type a client raises for a failed call, with a one-line message."""

from __future__ import annotations

import grpc

# Codes that mean "the daemon could not be reached or did not answer in time".
UNREACHABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
AUTH_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


class KVCacheError(Exception):
    """A call to blockd or computed failed.

    `service` is "blockd" or "computed", `address` where it was called, `code` the
    gRPC status and `details` the server's message. str() is always one line, e.g.
    "blockd at 127.0.0.1:50051 is unreachable (UNAVAILABLE)".
    """

    def __init__(self, service: str, address: str, code: grpc.StatusCode, details: str = "") -> None:
        self.service = service
        self.address = address
        self.code = code
        self.details = " ".join((details or "").split())
        super().__init__(self._message())

    @classmethod
    def from_rpc_error(cls, service: str, address: str, error: grpc.RpcError) -> KVCacheError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(service, address, code or grpc.StatusCode.UNKNOWN, details or "")

    @property
    def is_unreachable(self) -> bool:
        return self.code in UNREACHABLE_CODES

    @property
    def is_auth(self) -> bool:
        return self.code in AUTH_CODES

    def _message(self) -> str:
        where = f"{self.service} at {self.address}"
        if self.code is grpc.StatusCode.UNAVAILABLE:
            return f"{where} is unreachable (UNAVAILABLE)"
        if self.code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"{where} did not answer before the deadline (DEADLINE_EXCEEDED)"
        if self.code is grpc.StatusCode.UNIMPLEMENTED:  # most often: the other daemon's address
            other = "computed" if self.service == "blockd" else "blockd"
            return (
                f"{where} does not serve this {self.service} call (UNIMPLEMENTED): "
                f"is {self.address} {other}'s address?"
            )
        detail = self.details or "no details"
        return f"{where}: {detail} ({self.code.name})"
