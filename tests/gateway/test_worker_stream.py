"""The gateway's GenerateMany stream (gateway/worker_stream.py): live against real workers,
and against a worker that predates GenerateMany.

The worker "that predates it" is a GenerationService serving only Generate: exactly what
a computed built before the RPC existed answers (the generated base class's UNIMPLEMENTED).
"""

from __future__ import annotations

import grpc
import grpc.aio
import openai
import pytest

from gateway.worker_stream import WorkerStream
from kvcache.v1 import generation_pb2 as pb
from kvcache.v1 import generation_pb2_grpc as pb_grpc
from tests.gateway.conftest import MODEL, GatewayStack, unique_prompt


class _OlderWorker(pb_grpc.GenerationServiceServicer):
    """Generate only: two messages, the last with its finish reason."""

    async def Generate(self, request, context):
        yield pb.GenerateResponse(request_id="r", token_ids=[7], text="a")
        yield pb.GenerateResponse(request_id="r", token_ids=[8], text="b", finish_reason="length")


@pytest.fixture
async def older_worker():
    server = grpc.aio.server()
    pb_grpc.add_GenerationServiceServicer_to_server(_OlderWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.GenerationServiceStub(channel)
    await channel.close()
    await server.stop(None)


async def test_a_worker_without_generate_many_is_marked_and_its_request_fails_unimplemented(older_worker):
    stream = WorkerStream(older_worker)
    handle = await stream.generate(pb.GenerateRequest(prompt="x"), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await handle.read()
    assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert stream.is_unsupported, "its callers must fall back to Generate"
    assert await handle.read() is grpc.aio.EOF


async def test_a_handle_past_its_deadline_reads_deadline_exceeded(gw: GatewayStack):
    channel = grpc.aio.insecure_channel(gw.workers[0].address)
    try:
        stream = WorkerStream(pb_grpc.GenerationServiceStub(channel))
        request = pb.GenerateRequest(prompt=unique_prompt("deadline"), max_tokens=4000, ignore_eos=True)
        handle = await stream.generate(request, timeout=0.3)
        messages = 0
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            while True:
                message = await handle.read()
                assert message is not grpc.aio.EOF and not message.finish_reason
                messages += 1
        assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        # The stream serves on: the next request on it runs to its end.
        quick = await stream.generate(pb.GenerateRequest(prompt="import ", max_tokens=3, ignore_eos=True), 30)
        tokens = []
        while (message := await quick.read()) is not grpc.aio.EOF:
            tokens.extend(message.token_ids)
        assert len(tokens) == 3
    finally:
        await channel.close()
    assert gw.wait_idle().num_sequences == 0, "the expired request was cancelled at the worker"


async def test_a_broken_stream_fails_every_open_request_with_its_status(gw: GatewayStack):
    channel = grpc.aio.insecure_channel(gw.workers[1].address)
    stream = WorkerStream(pb_grpc.GenerationServiceStub(channel))
    handles = [
        await stream.generate(pb.GenerateRequest(prompt=unique_prompt(f"broken {i}"), max_tokens=4000), 60)
        for i in range(3)
    ]
    for handle in handles:
        await handle.read()  # each has started
    await channel.close()  # as when the connection to the worker breaks
    for handle in handles:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            while True:
                await handle.read()
        assert caught.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert gw.wait_idle().num_sequences == 0, "the worker aborted the stream's requests"


def test_per_request_streams_and_generate_many_answer_alike(gw: GatewayStack, open_gateway) -> None:
    """The same greedy requests through a gateway on GenerateMany and one without it."""
    plain = open_gateway([gw.workers[0].address], "--no-generate-many")
    many = open_gateway([gw.workers[0].address])
    prompts = [unique_prompt(f"alike {i}") for i in range(4)]
    answers = []
    for gateway in (plain, many):
        client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="-", max_retries=0)
        texts = []
        for p in prompts:
            streamed = client.completions.create(
                model=MODEL,
                prompt=p,
                max_tokens=12,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            texts.append("".join(c.choices[0].text for c in streamed if c.choices))
        answers.append(texts)
    assert answers[0] == answers[1]
    assert all(answers[0])
