"""computed's Steps on one StepStream (computed/step_stream.py) against a real blockd.

The stream carries every Step of the worker; a Step blockd refuses surfaces as the
unary call's `DirectoryUnavailable` and the next Step opens a new stream; a server that
does not serve StepStream (an older blockd) gets unary Steps, the refused one first.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest

from computed.directory_client import DirectoryClient, PoolSpec
from computed.directory_ops import AdmitOp, CommitOp, DirectoryOps
from computed.errors import DirectoryUnavailable
from computed.step_stream import StepStream
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc
from tests.blockd.conftest import make_config, start_inprocess

TOKENS = list(range(100, 124))  # 6 blocks of 4
SPEC = PoolSpec(num_blocks=16, block_size=4, model_id="m", model_revision="", dtype="", worker_address="w:1")


@contextlib.asynccontextmanager
async def _server(method: str, handler: grpc.RpcMethodHandler) -> AsyncIterator[StepStream]:
    """A BlockDirectoryService that serves only `method` (not blockd): a StepStream to it."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvcache.v1.BlockDirectoryService", {method: handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield StepStream(pb_grpc.BlockDirectoryServiceStub(channel), None)
    finally:
        await channel.close()
        await server.stop(0)


async def test_steps_travel_on_one_stream_and_a_refused_step_reopens_it() -> None:
    blockd = await start_inprocess(make_config())
    client = DirectoryClient(blockd.address, SPEC)
    try:
        await client.register()
        table = (await client.step(DirectoryOps(admits=[AdmitOp(1, TOKENS, "", 0)]))).admits[0].block_ids
        first_stream = client._steps._call
        assert first_stream is not None and not client._steps.is_unary
        await client.step(DirectoryOps(commits=[CommitOp(1, table, TOKENS)], releases=[1]))
        assert client._steps._call is first_stream  # the same stream, Step after Step
        client.lease.epoch -= 1  # a stale epoch: blockd refuses the Step, as it would a unary one
        with pytest.raises(DirectoryUnavailable, match="FAILED_PRECONDITION"):
            await client.step(DirectoryOps(admits=[AdmitOp(2, TOKENS, "", 0)]))
        assert client._steps._call is None and client.needs_recovery
        client.lease.epoch += 1
        again = await client.step(DirectoryOps(admits=[AdmitOp(3, TOKENS, "", 0)]))
        assert again.admits[0].num_cached_tokens == len(TOKENS)  # the first Steps stood
        assert client._steps._call is not None and client._steps._call is not first_stream
    finally:
        await client.close()
        await blockd.channel.close()
        await blockd.server.stop(0)


async def test_a_server_without_step_stream_gets_unary_steps() -> None:
    """A server that knows only the unary Step (an older blockd): UNIMPLEMENTED on the
    stream, then every Step (the first included) as a unary call."""
    seen: list[str] = []

    async def step(request: pb.StepRequest, context) -> pb.StepResponse:
        seen.append(request.pool_id)
        return pb.StepResponse(num_free_blocks=len(seen))

    handler = grpc.unary_unary_rpc_method_handler(
        step,
        request_deserializer=pb.StepRequest.FromString,
        response_serializer=pb.StepResponse.SerializeToString,
    )
    async with _server("Step", handler) as steps:
        first = await steps(pb.StepRequest(pool_id="a"), timeout=5)
        second = await steps(pb.StepRequest(pool_id="b"), timeout=5)
        assert steps.is_unary and seen == ["a", "b"]
        assert (first.num_free_blocks, second.num_free_blocks) == (1, 2)


async def test_a_silent_server_is_a_deadline_not_a_hang() -> None:
    """A stream that never answers: the Step fails after its timeout as DEADLINE_EXCEEDED
    (the unary call's status for the same wait), and the stream is dropped."""

    async def never(requests, context):
        async for _ in requests:
            pass
        yield pb.StepResponse()  # pragma: no cover - the client gives up first

    handler = grpc.stream_stream_rpc_method_handler(
        never,
        request_deserializer=pb.StepStreamRequest.FromString,
        response_serializer=pb.StepStreamResponse.SerializeToString,
    )
    async with _server("StepStream", handler) as steps:
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await steps(pb.StepRequest(pool_id="a"), timeout=0.3)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert steps._call is None and not steps.is_unary
