"""One generation on a worker, counted in its in-flight load, cancelled when dropped.

`Generation.start` places the request (see gateway.fleet), opens it on the worker's
GenerateMany stream (gateway/worker_stream.py; a Generate call of its own where the worker
is older or the gateway runs with --no-generate-many) and waits for its first message, so
every failure before the first token becomes the response's HTTP status; a worker unreachable before its first message is replaced by another of
the model's. `close` cancels the gRPC call (computed aborts the sequence and releases
its blocks) and is safe to call at any time, any number of times; a stream that has
delivered its last message is not cancelled (nothing to abort, and a cancel costs a
round of work in grpc's core on the hot path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping

import grpc
import grpc.aio

from clients.errors import KVCacheError
from clients.requests import Prompt, SamplingParams
from clients.types import GenerateChunk
from gateway.errors import from_daemon
from gateway.fleet import Fleet, Placement, Worker
from gateway.worker_stream import Handle


class Generation:
    def __init__(
        self,
        fleet: Fleet,
        model: str,
        prompt: Prompt,
        sampling: SamplingParams,
        fields: Mapping[str, str] | None = None,
    ) -> None:
        """`fields`: the worker's field names -> the request's, for its refusals (from_daemon)."""
        self._fleet = fleet
        self._fields = fields
        self._model = model
        self._prompt = prompt
        self._sampling = sampling
        self._call: grpc.aio.UnaryStreamCall | Handle | None = None
        self.worker: Worker | None = None
        self._placement: Placement | None = None
        self._waiting = False  # counted in the worker's queued prefill
        self.head: GenerateChunk | None = None
        self._finished = False

    async def start(self) -> None:
        """Place, send, and read the first message; raises ApiError."""
        try:
            placement = await self._fleet.place(self._model, self._prompt)
            while True:
                await self._open(placement)
                try:
                    self.head = await self._read()
                    self._prefilled()
                    return
                except KVCacheError as error:
                    if error.code is grpc.StatusCode.UNIMPLEMENTED and self._older(placement.worker):
                        self._release()  # a computed older than GenerateMany: by Generate
                        continue
                    if error.code is not grpc.StatusCode.UNAVAILABLE:
                        raise
                    self._release()
                    nxt = self._fleet.failover(self._model, placement.worker)
                    if nxt is None:
                        raise
                    placement = dataclasses.replace(placement, worker=nxt)
        except KVCacheError as error:
            self.close()
            raise from_daemon(error, self._fields) from None
        except BaseException:
            self.close()
            raise

    async def chunks(self) -> AsyncIterator[GenerateChunk]:
        """Every message, the head first; raises ApiError on a failure mid-stream."""
        try:
            chunk = self.head
            while chunk is not None:
                yield chunk
                if chunk.finish_reason:
                    self._finished = True
                    return
                chunk = await self._read()
        except KVCacheError as error:
            raise from_daemon(error, self._fields) from None
        finally:
            self.close()

    def close(self) -> None:
        if self._call is not None and not self._finished:
            self._call.cancel()
        self._release()

    async def _open(self, placement: Placement) -> None:
        worker = placement.worker
        self.worker, self._placement = worker, placement
        worker.admit(placement)
        self._waiting = True
        request = placement.prompt.to_request(self._sampling)
        self._finished = False
        timeout = self._fleet.config.request_timeout
        stream = worker.stream
        if stream is not None and not stream.is_unsupported:
            self._call = await stream.generate(request, timeout)
        else:
            self._call = worker.stub.Generate(request, timeout=timeout)

    def _older(self, worker: Worker) -> bool:
        """This request went on the worker's stream, which was found unserved since."""
        return isinstance(self._call, Handle) and worker.stream is not None and worker.stream.is_unsupported

    def _prefilled(self) -> None:
        if self._waiting and self._placement is not None:
            self._placement.worker.first_token(self._placement)
            self._waiting = False

    def _release(self) -> None:
        if self.worker is not None and self._call is not None:
            self._prefilled()
            self.worker.release()
            self._call = None

    async def _read(self) -> GenerateChunk | None:
        assert self._call is not None and self.worker is not None
        try:
            message = await self._call.read()
        except grpc.RpcError as error:
            raise KVCacheError.from_rpc_error("computed", self.worker.address, error) from None
        if message is grpc.aio.EOF:
            return None
        return GenerateChunk.from_proto(message)
