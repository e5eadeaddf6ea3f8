"""StepStream: the same Steps on one long-lived stream (directory.proto).

Each request is applied exactly as the unary Step applies it and answered in order;
the first Step that Step would refuse ends the stream with Step's status and message,
the Steps answered before it standing; the worker token is checked when the stream
opens; bytes that do not parse are INVALID_ARGUMENT, and blockd keeps serving.
"""

from __future__ import annotations

import dataclasses
import random

import grpc
import pytest

from kvcache.v1 import directory_pb2 as pb
from tests.blockd.conftest import make_config, start_inprocess

BLOCK = 4
METHOD = "/kvcache.v1.BlockDirectoryService/StepStream"


async def _register(env, worker: str) -> pb.RegisterPoolResponse:
    return await env.workers.RegisterPool(
        pb.RegisterPoolRequest(
            num_blocks=24, block_size=BLOCK, namespace=pb.Namespace(model_id="m"), worker_address=worker
        )
    )


def _steps(pool: pb.RegisterPoolResponse, seed: int) -> list[pb.StepRequest]:
    """Admissions of prompts sharing a prefix in a small pool (hits and evictions), the
    commit of each one's prompt blocks in the next Step, its release in the one after."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 1000) for _ in range(3 * BLOCK)]
    steps = []
    for i in range(12):
        step = pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch)
        tail = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 4 * BLOCK))]
        step.admits.add(sequence_id=i, token_ids=prefix + tail)
        if i >= 1:
            step.commits.add(sequence_id=i - 1, block_ids=[])  # placeholder: filled from the answers
        if i >= 2:
            step.releases.add(sequence_id=i - 2)
        steps.append(step)
    return steps


async def _run_unary(env, steps: list[pb.StepRequest]) -> list[pb.StepResponse]:
    replies: list[pb.StepResponse] = []
    tables: dict[int, list[int]] = {}
    for step in steps:
        _fill_commits(step, tables)
        reply = await env.workers.Step(step)
        _remember(step, reply, tables)
        replies.append(reply)
    return replies


async def _run_stream(env, steps: list[pb.StepRequest]) -> list[pb.StepResponse]:
    call = env.workers.StepStream()
    replies: list[pb.StepResponse] = []
    tables: dict[int, list[int]] = {}
    for step in steps:
        _fill_commits(step, tables)
        await call.write(pb.StepStreamRequest(step=step))
        reply = (await call.read()).step
        _remember(step, reply, tables)
        replies.append(reply)
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    return replies


def _fill_commits(step: pb.StepRequest, tables: dict[int, list[int]]) -> None:
    """Each commit: the admitted prompt's full blocks after its cached ones, by index."""
    kept = []
    for commit in step.commits:
        run = tables.get(commit.sequence_id, [])
        if run:
            kept.append(pb.CommitOp(sequence_id=commit.sequence_id, block_ids=run))
    del step.commits[:]
    step.commits.extend(kept)
    releases = [r for r in step.releases if r.sequence_id in tables]
    del step.releases[:]
    step.releases.extend(releases)


def _remember(step: pb.StepRequest, reply: pb.StepResponse, tables: dict[int, list[int]]) -> None:
    prompts = {a.sequence_id: len(a.token_ids) for a in step.admits}
    for admit in reply.admits:
        if admit.admitted:
            first, end = admit.num_cached_tokens // BLOCK, prompts[admit.sequence_id] // BLOCK
            tables[admit.sequence_id] = list(admit.block_ids[first:end])


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_stream_answers_each_step_as_the_unary_call_does(blockd, seed: int) -> None:
    one, two = await _register(blockd, "w1:1"), await _register(blockd, "w2:1")
    by_call = await _run_unary(blockd, _steps(one, seed))
    by_stream = await _run_stream(blockd, _steps(two, seed))
    assert by_stream == by_call
    assert any(a.num_cached_tokens for r in by_call for a in r.admits), "the run must hit the cache"


async def test_a_refused_step_ends_the_stream_with_steps_status_and_the_earlier_steps_stand(blockd) -> None:
    pool = await _register(blockd, "w:1")
    call = blockd.workers.StepStream()
    admit = pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch)
    admit.admits.add(sequence_id=7, token_ids=list(range(1, 3 * BLOCK + 1)))
    await call.write(pb.StepStreamRequest(step=admit))
    assert (await call.read()).step.admits[0].admitted
    stale = pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch - 1)
    stale.releases.add(sequence_id=7)
    await call.write(pb.StepStreamRequest(step=stale))
    with pytest.raises(grpc.aio.AioRpcError) as streamed:
        await call.read()
    with pytest.raises(grpc.aio.AioRpcError) as unary:
        await blockd.workers.Step(stale)
    assert streamed.value.code() == unary.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert streamed.value.details() == unary.value.details()
    # the admission before it stands: sequence 7 is live and releases once
    release = pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch)
    release.releases.add(sequence_id=7)
    await blockd.workers.Step(release)
    stats = (await blockd.stats()).total
    assert stats.num_sequences == 0 and stats.num_referenced_blocks == 0


async def test_the_worker_token_is_checked_when_the_stream_opens() -> None:
    config = dataclasses.replace(make_config(), worker_token="worker-secret")
    env = await start_inprocess(config)
    try:
        for metadata, code in (
            ((), grpc.StatusCode.UNAUTHENTICATED),
            ((("authorization", "Bearer wrong"),), grpc.StatusCode.PERMISSION_DENIED),
        ):
            call = env.workers.StepStream(metadata=metadata)
            # The refusal may end the call before the write completes: either raises it.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.write(pb.StepStreamRequest(step=pb.StepRequest(pool_id="p", epoch=1)))
                await call.read()
            assert refused.value.code() == code
        good = (("authorization", "Bearer worker-secret"),)
        pool = await env.workers.RegisterPool(
            pb.RegisterPoolRequest(num_blocks=8, block_size=BLOCK, namespace=pb.Namespace(model_id="m")),
            metadata=good,
        )
        call = env.workers.StepStream(metadata=good)
        await call.write(pb.StepStreamRequest(step=pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch)))
        assert (await call.read()).step.num_free_blocks == 8
        await call.done_writing()
    finally:
        await env.channel.close()
        await env.server.stop(0)


async def test_bytes_that_do_not_parse_are_invalid_argument_and_blockd_keeps_serving(blockd) -> None:
    raw = blockd.channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)
    call = raw()
    await call.write(b"\x0a\x05\xff\xff")  # field 1 (step), length 5, only 2 bytes follow
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call.read()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "StepStreamRequest" in refused.value.details()
    pool = await _register(blockd, "w:1")
    stream = blockd.workers.StepStream()
    await stream.write(pb.StepStreamRequest(step=pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch)))
    assert (await stream.read()).step.num_free_blocks == 24
