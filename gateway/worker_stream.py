"""All of one worker's generations on one `GenerateMany` stream (generation.proto).

Why: with a Generate call per request, every streamed token is a gRPC message: ~50-60 us
of the gateway's CPU to receive and ~70-90 us of the worker's to send (profiled under
`python -m bench --only serving`, 32 streams in flight). On one stream the worker sends
one message per engine step for all of them.

Invariants:
- At most one stream per worker is open; the first request opens it, and the first
  after it ended opens the next.
- A `Handle` reads, in order, exactly the messages its Generate call would have carried,
  or an error with the status Generate would have ended with in place of the rest; after
  its last message, `read` answers EOF.
- A stream that fails fails every request still open on it with its status (UNAVAILABLE
  when it ended without one), as a broken connection fails each Generate call.
- A worker that answers UNIMPLEMENTED (a computed older than GenerateMany) is marked
  `is_unsupported`: its callers use Generate from then on.
- One write in flight per stream (grpc's rule), in the order requests were made, so a
  cancel never overtakes its request's start.
- A handle whose deadline passes reads DEADLINE_EXCEEDED and is cancelled at the worker.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import grpc
import grpc.aio
import structlog

from kvcache.v1 import generation_pb2 as pb
from kvcache.v1 import generation_pb2_grpc as pb_grpc

log = structlog.get_logger("gateway.worker_stream")

_CANCEL = pb.GenerateCancel()


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class WorkerStream:
    """Opens `Handle`s, each one request, on the worker's current stream."""

    def __init__(self, stub: pb_grpc.GenerationServiceStub) -> None:
        self._stub = stub
        self._keys = itertools.count(1)
        self._current: _Stream | None = None
        self.is_unsupported = False

    async def generate(self, request: pb.GenerateRequest, timeout: float) -> Handle:
        """Start one request; its messages are read from the returned handle."""
        stream = self._current
        if stream is None or stream.is_over:
            stream = self._current = _Stream(self, self._stub.GenerateMany())
        handle = Handle(stream, next(self._keys), timeout)
        await stream.start(handle, request)
        return handle


class _Stream:
    """One GenerateMany call, the handles open on it, and the task reading it."""

    def __init__(self, owner: WorkerStream, call: grpc.aio.StreamStreamCall) -> None:
        self._owner = owner
        self._call = call
        self._lock = asyncio.Lock()
        self._handles: dict[int, Handle] = {}
        self._cancels: set[asyncio.Task] = set()  # held: the loop keeps only weak references
        self.is_over = False
        self._reader = asyncio.create_task(self._read())

    async def start(self, handle: Handle, request: pb.GenerateRequest) -> None:
        self._handles[handle.key] = handle
        await self._write(pb.GenerateManyRequest(key=handle.key, generate=request))

    def cancel(self, key: int) -> None:
        """Stop reading the key; the worker aborts it (its last update is not awaited)."""
        if self._handles.pop(key, None) is not None and not self.is_over:
            task = asyncio.get_running_loop().create_task(
                self._write(pb.GenerateManyRequest(key=key, cancel=_CANCEL))
            )
            self._cancels.add(task)
            task.add_done_callback(self._cancels.discard)

    async def _write(self, message: pb.GenerateManyRequest) -> None:
        async with self._lock:
            if self.is_over:
                return  # its handles were failed with the stream's status
            try:
                await self._call.write(message)
            except (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                pass  # the stream broke: the reader fails every open handle with its status

    async def _read(self) -> None:
        error = _error(grpc.StatusCode.UNAVAILABLE, "computed ended the GenerateMany stream")
        try:
            async for reply in self._call:
                self._dispatch(reply)
        except grpc.aio.AioRpcError as failure:
            error = failure
            if failure.code() is grpc.StatusCode.UNIMPLEMENTED:
                log.warning("worker does not serve GenerateMany (an older computed?): Generate from now on")
                self._owner.is_unsupported = True
        except asyncio.CancelledError:
            error = _error(grpc.StatusCode.CANCELLED, "the gateway closed the GenerateMany stream")
            raise
        except Exception as failure:  # the handles must learn the stream is gone
            log.exception("GenerateMany stream failed")
            error = _error(grpc.StatusCode.INTERNAL, f"GenerateMany stream failed: {failure!r}")
        finally:
            self.is_over = True
            handles, self._handles = self._handles, {}
            for handle in handles.values():
                handle.deliver(error)

    def _dispatch(self, reply: pb.GenerateManyResponse) -> None:
        handles = self._handles
        for update in reply.updates:
            handle = handles.get(update.key)
            if handle is None:
                continue  # cancelled here: the worker's last words for it
            if update.error_code:
                del handles[update.key]
                code = _CODES.get(update.error_code, grpc.StatusCode.UNKNOWN)
                handle.deliver(_error(code, update.error_message))
            else:
                if update.response.finish_reason:
                    del handles[update.key]
                handle.deliver(update.response)


class Handle:
    """One request on a stream, read like a Generate call (`read`, `cancel`)."""

    def __init__(self, stream: _Stream, key: int, timeout: float) -> None:
        self._stream = stream
        self.key = key
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._ended = False  # its last message or error was read
        self._timer = asyncio.get_running_loop().call_later(timeout, self._expire, timeout)

    def deliver(self, item: pb.GenerateResponse | grpc.aio.AioRpcError) -> None:
        if isinstance(item, grpc.aio.AioRpcError) or item.finish_reason:
            self._timer.cancel()
        self._queue.put_nowait(item)

    async def read(self) -> pb.GenerateResponse | Any:
        """The next message, or grpc.aio.EOF after the last; raises the request's error."""
        if self._ended:
            return grpc.aio.EOF
        item = await self._queue.get()
        if isinstance(item, grpc.aio.AioRpcError):
            self._ended = True
            raise item
        if item.finish_reason:
            self._ended = True
        return item

    def cancel(self) -> None:
        self._timer.cancel()
        self._stream.cancel(self.key)

    def _expire(self, timeout: float) -> None:
        self._stream.cancel(self.key)
        self._queue.put_nowait(
            _error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no last message within {timeout} s")
        )
