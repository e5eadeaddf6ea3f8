"""Host tier: hit rate of a prefix trace under memory pressure, the TTFT of a prefix
served from device, host tier or recompute, and what the tier costs a decode-heavy run.

1. Replay (blockd's core, no gRPC): conversations over Zipf families
   (`bench.tier_trace`), the device pool at 2%, 5% and 10% of the trace's distinct
   blocks, alone and with a host tier 4x its size (demoting every evicted block, or
   only those seen twice), each ÷ an unbounded cache.
2. TTFT through gRPC: a fresh 4,096-token prefix + 64 new tokens, first cold
   (recompute), then again with other new tokens (device hit), then after two other
   4K prompts pushed it out of the device pool (host tier hit). Medians.
3. Decode-heavy: 32 streams x 128 tokens, computed with and without a host tier.
"""

from __future__ import annotations

import asyncio
import random

from bench.context import BenchContext
from bench.driver import generate_one, run_sync
from bench.report import BenchResult, Figure, Goal, median
from bench.stack import Stack
from bench.tier_trace import (
    BLOCK_SIZE,
    ConversationSpec,
    conversation_trace,
    num_distinct_blocks,
    replay_tiers,
)
from bench.workloads import random_tokens, unrelated_prompts
from clients.aio_client import AsyncComputedClient

TITLE = "9. Host tier: hit rate under pressure, TTFT by tier, decode cost"
PREFIX = 4096
NEW = 64
# Blocks: one 4K prompt (+64) is 260 of them; 300 cannot hold two, so a second 4K
# prompt evicts the first. The host tier holds four pools' worth.
TTFT_ARGS = ("--max-num-batched-tokens", "8192", "--num-blocks", "300")
HOST_BYTES = 4 * 300 * 32 * 1024  # the default model: 32 KiB per block


def run(ctx: BenchContext) -> BenchResult:
    figures: list[Figure] = []
    replay_table, replay_figures = _replay(ctx.quick)
    figures += replay_figures
    ttft = _ttft(ctx)
    figures.append(
        Figure(
            "TTFT host tier hit ÷ recompute, 4K prefix",
            round(ttft["host"] / ttft["cold"], 4),
            "",
            Goal("<=", 0.2),
        )
    )
    figures.append(Figure("TTFT device hit ÷ recompute, 4K prefix", round(ttft["device"] / ttft["cold"], 4)))
    decode = _decode(ctx)
    figures.append(
        Figure(
            "decode-heavy wall, host tier on ÷ off",
            round(decode["on"] / decode["off"], 4),
            "",
            Goal("<=", 1.02),
        )
    )
    details = (
        "Replay of a conversation trace (hit rate ÷ an unbounded cache; host tier = 4x the device pool):\n\n"
        + "\n".join(replay_table)
        + "\n\nTTFT (median, ms), 4,096-token prefix + 64 new tokens, computed `"
        + " ".join(TTFT_ARGS)
        + f" --host-kv-memory {HOST_BYTES}`:\n\n| served from | TTFT (ms) | ÷ recompute |\n|---|---|---|\n"
        + "\n".join(
            f"| {name} | {ttft[key] * 1e3:.1f} | {ttft[key] / ttft['cold']:.3f} |"
            for name, key in (("recompute", "cold"), ("device pool", "device"), ("host tier", "host"))
        )
        + f"\n\nDecode-heavy (32 x 128 tokens out, 32 in flight), best of {decode['repeats']} per setup: "
        f"{decode['off']:.2f} s without a host tier, {decode['on']:.2f} s with one."
    )
    return BenchResult("tiers", TITLE, figures, details)


def _replay(quick: bool) -> tuple[list[str], list[Figure]]:
    spec = ConversationSpec(num_conversations=60 if quick else 160)
    trace = conversation_trace(spec)
    distinct = num_distinct_blocks(trace)
    largest = max(len(p) for p in trace) // BLOCK_SIZE + 2
    unbounded = replay_tiers(trace, distinct + largest).hit_rate
    rows = [
        (
            f"Trace: {len(trace)} requests, {sum(map(len, trace)):,} prompt tokens, {distinct:,} distinct "
            f"blocks of {BLOCK_SIZE}; unbounded cache hit rate {unbounded:.3f}."
        ),
        "",
        "| device pool | blocks | device alone | + host tier (every eviction) | + host tier (seen twice) |",
        "|---|---|---|---|---|",
    ]
    figures = []
    worst = 1.0
    for fraction in (0.02, 0.05, 0.10):
        n = max(int(distinct * fraction), largest)
        alone = replay_tiers(trace, n).hit_rate / unbounded
        every = replay_tiers(trace, n, 4 * n).hit_rate / unbounded
        twice = replay_tiers(trace, n, 4 * n, demote_min_hits=1).hit_rate / unbounded
        worst = min(worst, every)
        rows.append(f"| {fraction:.0%} | {n:,} | {alone:.3f} | {every:.3f} | {twice:.3f} |")
        figures.append(Figure(f"hit rate ÷ unbounded, device {fraction:.0%} alone", round(alone, 3)))
    figures.append(
        Figure("hit rate ÷ unbounded with host tier (worst of 2/5/10%)", round(worst, 3), "", Goal(">=", 0.9))
    )
    return rows, figures


def _ttft(ctx: BenchContext) -> dict[str, float]:
    repeats = 1 if ctx.quick else 3
    args = (*TTFT_ARGS, "--host-kv-memory", str(HOST_BYTES))
    with Stack(ctx.scratch("tiers-ttft"), *args, threads=ctx.threads) as stack:
        samples = asyncio.run(_ttft_samples(stack.computed_address, repeats))
    return {key: median(s[key] for s in samples) for key in ("cold", "device", "host")}


async def _ttft_samples(address: str, repeats: int) -> list[dict[str, float]]:
    rng = random.Random(12)
    samples = []
    async with AsyncComputedClient(address) as client:
        for prompt in unrelated_prompts(97, 1, PREFIX + NEW):  # warm-up: the largest shapes
            await generate_one(client, prompt, 1)
        for _ in range(repeats):
            prefix = random_tokens(rng, PREFIX)
            cold = await generate_one(client, prefix + random_tokens(rng, NEW), 1)
            device = await generate_one(client, prefix + random_tokens(rng, NEW), 1)
            for other in unrelated_prompts(rng.randrange(1 << 30), 2, PREFIX + NEW):
                await generate_one(client, other, 1)  # pushes the prefix out of the device pool
            host = await generate_one(client, prefix + random_tokens(rng, NEW), 1)
            assert cold.cached_tokens == 0 and device.cached_tokens >= PREFIX, (cold, device)
            assert host.cached_tokens >= PREFIX, f"the prefix did not come back from the host tier: {host}"
            samples.append({"cold": cold.ttft_s, "device": device.ttft_s, "host": host.ttft_s})
    return samples


def _decode(ctx: BenchContext) -> dict[str, float]:
    """Both setups up at once and run alternately, so machine noise falls on both."""
    repeats = 1 if ctx.quick else 4
    prompts = unrelated_prompts(31, 32, 32)
    best = {"off": float("inf"), "on": float("inf")}
    with (
        Stack(ctx.scratch("tiers-off"), "--host-kv-memory", "0", threads=ctx.threads) as off,
        Stack(ctx.scratch("tiers-on"), "--host-kv-memory", str(HOST_BYTES), threads=ctx.threads) as on,
    ):
        stacks = {"off": off, "on": on}
        for stack in stacks.values():
            run_sync(stack.computed_address, prompts[:4], 8, 4)  # warm-up
        for _ in range(repeats):
            for name, stack in stacks.items():
                best[name] = min(best[name], run_sync(stack.computed_address, prompts, 128, 32).wall_s)
    return {**best, "repeats": repeats}
