"""computed's Steps on one `StepStream` (directory.proto) instead of a unary call each.

Why: a Step on a long-lived stream costs blockd about half the CPU of a unary call, and
a GPU worker sends tens of Steps a second (bench.blockd_fleet: stream ÷ unary, closed
loop). The stream changes nothing else: each Step is answered as the unary call
answers it, and a Step blockd refuses ends the stream with the unary call's status.

Invariants:
- One Step in flight on the stream (a lock): answers pair with requests by order.
- Any failure (an error status, no answer within the timeout, the stream ended) drops
  the stream and surfaces as the `grpc.aio.AioRpcError` the unary call would raise, so
  the caller's error handling is the unary call's; the next Step opens a new stream.
- A blockd that does not serve StepStream (UNIMPLEMENTED: an older blockd) gets unary
  Steps from then on, the refused Step among them.
"""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import structlog

from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc

log = structlog.get_logger("computed.directory")


class StepStream:
    """Callable like the stub's `Step`: `await steps(request, timeout=..., metadata=...)`."""

    _method = b"/kvcache.v1.BlockDirectoryService/StepStream"  # what error logs name

    def __init__(self, stub: pb_grpc.BlockDirectoryServiceStub, metadata: tuple | None) -> None:
        self._stub = stub
        self._metadata = metadata
        self._call: grpc.aio.StreamStreamCall | None = None
        self._lock = asyncio.Lock()
        self.is_unary = False  # blockd answered UNIMPLEMENTED: unary Steps from then on

    async def __call__(
        self, request: pb.StepRequest, timeout: float, metadata: tuple | None = None
    ) -> pb.StepResponse:
        if self.is_unary:
            return await self._stub.Step(request, timeout=timeout, metadata=self._metadata)
        async with self._lock:
            call = self._call
            if call is None:
                call = self._call = self._stub.StepStream(metadata=self._metadata)
            try:
                await asyncio.wait_for(call.write(pb.StepStreamRequest(step=request)), timeout)
                reply = await asyncio.wait_for(call.read(), timeout)
            except TimeoutError:
                self.close()
                raise _error(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer to a Step within {timeout} s"
                ) from None
            except grpc.aio.AioRpcError as error:
                self.close()
                if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.warning("blockd does not serve StepStream (an older blockd?): unary Steps from now on")
                self.is_unary = True
                return await self._stub.Step(request, timeout=timeout, metadata=self._metadata)
            except (asyncio.InvalidStateError, grpc.aio.UsageError):  # written after the stream ended
                code, details = await call.code(), await call.details()
                self.close()
                raise _error(
                    code or grpc.StatusCode.UNAVAILABLE, details or "the Step stream ended"
                ) from None
            if reply is grpc.aio.EOF:
                self.close()
                raise _error(grpc.StatusCode.UNAVAILABLE, "blockd ended the Step stream")
            return reply.step

    def close(self) -> None:
        """Drop the stream (the next Step opens a new one)."""
        if self._call is not None:
            self._call.cancel()
            self._call = None


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
