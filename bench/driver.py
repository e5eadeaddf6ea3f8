"""Load generator: send token-id prompts to computed over gRPC, at most C in flight.

Each request is timed from the call to its first token (TTFT, client side) and to its
last message; the final message's usage (cached tokens, completion tokens) is kept.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from clients.aio_client import AsyncComputedClient


@dataclass(frozen=True)
class Outcome:
    token_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float  # client side: call -> first message with a token
    total_s: float
    server_ttft_s: float  # usage.time_to_first_token_seconds


@dataclass(frozen=True)
class RunOutcome:
    outcomes: list[Outcome]  # in prompt order
    wall_s: float  # first call -> last completion

    @property
    def num_completion_tokens(self) -> int:
        return sum(o.completion_tokens for o in self.outcomes)

    @property
    def num_cached_tokens(self) -> int:
        return sum(o.cached_tokens for o in self.outcomes)


async def generate_one(
    client: AsyncComputedClient,
    token_ids: Sequence[int],
    max_tokens: int,
    timeout: float = 600.0,
    stream_interval: int = 0,
) -> Outcome:
    started = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    usage = None
    stream = client.generate(
        token_ids=list(token_ids),
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=0.0,
        timeout=timeout,
        stream_interval=stream_interval,
    )
    async for chunk in stream:
        if chunk.token_ids and first is None:
            first = time.perf_counter()
        tokens.extend(chunk.token_ids)
        if chunk.usage is not None:
            usage = chunk.usage
    ended = time.perf_counter()
    assert usage is not None, "the stream ended without usage"
    return Outcome(
        tuple(tokens),
        usage.prompt_tokens,
        usage.cached_tokens,
        usage.completion_tokens,
        (first or ended) - started,
        ended - started,
        usage.time_to_first_token_seconds,
    )


async def run_requests(
    address: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    concurrency: int,
    stream_interval: int = 0,
) -> RunOutcome:
    """All prompts through one channel, `concurrency` streams at a time (each streamed
    per `stream_interval`, see GenerateRequest)."""
    async with AsyncComputedClient(address) as client:
        return await run_on(client, prompts, max_tokens, concurrency, stream_interval)


async def run_on(
    client: AsyncComputedClient,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    concurrency: int,
    stream_interval: int = 0,
) -> RunOutcome:
    """`run_requests` through a client already connected (a chat's turns share one)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: Sequence[int]) -> Outcome:
        async with gate:
            return await generate_one(client, prompt, max_tokens, stream_interval=stream_interval)

    started = time.perf_counter()
    outcomes = await asyncio.gather(*(one(p) for p in prompts))
    return RunOutcome(list(outcomes), time.perf_counter() - started)


def run_sync(
    address: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    concurrency: int,
    stream_interval: int = 0,
) -> RunOutcome:
    return asyncio.run(run_requests(address, prompts, max_tokens, concurrency, stream_interval))
