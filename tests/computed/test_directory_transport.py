"""computed's directory client tells a lost blockd from a refusal by blockd."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import structlog

from computed.directory_client import DirectoryClient, _transport_lost
from computed.errors import DirectoryUnavailable


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize(
    ("code", "details", "refused"),
    [
        (grpc.StatusCode.INTERNAL, "Internal error from Core", False),  # gRPC's own: the connection died
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", False),
        (grpc.StatusCode.INTERNAL, "directory invariant violated", True),  # an answer of blockd's
        (grpc.StatusCode.INVALID_ARGUMENT, "sequence 7 is not live", True),
    ],
)
def test_a_lost_blockd_is_not_logged_as_a_refusal(code: grpc.StatusCode, details: str, refused: bool) -> None:
    assert _transport_lost(rpc_error(code, details)) is (code == grpc.StatusCode.INTERNAL and not refused)
    client = DirectoryClient.__new__(DirectoryClient)  # `_call` reads only these two
    client.call_timeout, client._metadata = 1.0, ()

    async def method(request, timeout, metadata):
        raise rpc_error(code, details)

    with structlog.testing.capture_logs() as logs, pytest.raises(DirectoryUnavailable):
        asyncio.run(client._call(method, None))
    assert any(entry["event"] == "blockd_refused" for entry in logs) is refused, logs
