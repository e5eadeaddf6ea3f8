"""Load: 32 concurrent streaming clients in rounds, some cancelling mid-stream.

What must hold: zero errors, every non-cancelled request complete, nothing referenced
after each round, and the resident memory of both daemons steady from round 2 on (the
first round warms caches and allocators).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvcache.v1 import generation_pb2 as gpb
from kvcache.v1 import generation_pb2_grpc as ggrpc
from tests.reliability.stack import BLOCK, assert_accounting, rss_bytes, start_stack, stop_stack, tokens

CONCURRENCY = 32
CANCEL_EVERY = 6  # every 6th request cancels after its second message
# Allowed RSS growth from the second round to the last: a little slack for allocator noise.
RSS_SLACK_BYTES = 6 << 20
RSS_SLACK_FRACTION = 0.03


@dataclass
class Tally:
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    cached_tokens: int = 0


async def one_request(stub, rng: random.Random, index: int, tally: Tally, system: list[int]) -> None:
    prompt = (system if index % 3 else []) + tokens(rng.randrange(10_000), rng.randint(3, 40))
    max_tokens = rng.randint(4, 24)
    request = gpb.GenerateRequest(
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        ignore_eos=True,
        cache_salt="" if index % 5 else f"tenant-{index % 4}",
    )
    call = stub.Generate(request, timeout=120)
    cancel = index % CANCEL_EVERY == 0
    received = 0
    try:
        async for message in call:
            received += len(message.token_ids)
            if cancel and received >= 2:
                call.cancel()
                tally.cancelled += 1
                return
            if message.finish_reason:
                assert message.finish_reason == "length" and received == max_tokens, (message, received)
                tally.cached_tokens += message.usage.cached_tokens
        tally.completed += 1
    except asyncio.CancelledError:
        raise
    except grpc.aio.AioRpcError as exc:
        if not (cancel and exc.code() == grpc.StatusCode.CANCELLED):
            tally.errors += 1
            raise


async def run_round(address: str, num_requests: int, seed: int) -> Tally:
    rng = random.Random(seed)
    system = tokens(9, 6 * BLOCK)
    tally = Tally()
    gate = asyncio.Semaphore(CONCURRENCY)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = ggrpc.GenerationServiceStub(channel)

        async def gated(i: int) -> None:
            async with gate:
                await one_request(stub, rng, i, tally, system)

        results = await asyncio.gather(*(gated(i) for i in range(num_requests)), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, f"{len(failures)} requests failed, e.g. {failures[:3]}"
    return tally


@pytest.mark.parametrize("rounds, per_round", [(4, 96), pytest.param(8, 256, marks=pytest.mark.slow)])
def test_concurrent_streams_with_cancellations_leak_nothing(
    tmp_path: Path, tiny_model: Path, rounds: int, per_round: int
) -> None:
    stack = start_stack(tmp_path, tiny_model, [], ["--num-blocks", "512"])
    try:
        rss: list[tuple[int, int]] = []
        total = Tally()
        for r in range(rounds):
            tally = asyncio.run(run_round(stack.computed.address, per_round, seed=r))
            assert tally.errors == 0
            assert tally.completed + tally.cancelled == per_round
            assert tally.cancelled == len(range(0, per_round, CANCEL_EVERY))
            idle = stack.wait_idle()
            assert idle.num_referenced_blocks == 0 and idle.num_sequences == 0, (r, idle)
            assert_accounting(idle)
            rss.append((rss_bytes(stack.blockd.proc.pid), rss_bytes(stack.computed.proc.pid)))
            total.completed += tally.completed
            total.cancelled += tally.cancelled
            total.cached_tokens += tally.cached_tokens
        assert total.cached_tokens > 0, "the shared system prompt never hit the cache"
        for name, series in (("blockd", [b for b, _ in rss]), ("computed", [c for _, c in rss])):
            growth = series[-1] - series[1]
            allowed = RSS_SLACK_BYTES + RSS_SLACK_FRACTION * series[1]
            assert growth <= allowed, f"{name} RSS grew {growth / 2**20:.1f} MiB after warm-up: {series}"
        print(f"load: {total.completed} completed, {total.cancelled} cancelled, RSS (blockd, computed) {rss}")
    finally:
        codes = stop_stack(stack)
    assert codes == (0, 0)
