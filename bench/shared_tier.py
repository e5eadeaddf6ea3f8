"""Shared tier: the TTFT of a prefix computed on another worker, and the hit rate of a
two-worker trace with and without the shared tier.

1. TTFT through gRPC, a real Valkey server, blockd and two workers (default model,
   measured costs): a fresh 2,048-token prefix + 64 new tokens computed on worker A
   (recompute), then the same prefix with other new tokens on worker B, which holds
   nothing of it: served from the shared tier. Medians.
2. Replay (blockd's core, no gRPC, no store): the conversation trace of the host tier
   section, each conversation pinned to one of two workers but every tenth request
   sent to the other (a rebalanced or failed-over request), device pools at 5% of the
   trace's distinct blocks each, with and without a shared tier (unbounded: the store's
   memory cap is the server's), each ÷ one unbounded cache.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

from bench.context import BenchContext
from bench.driver import generate_one
from bench.report import BenchResult, Figure, Goal, median
from bench.tier_trace import (
    BLOCK_SIZE,
    ConversationSpec,
    conversation_trace,
    num_distinct_blocks,
    replay_tiers,
)
from bench.workloads import random_tokens, unrelated_prompts
from blockd.config import DirectoryConfig
from blockd.directory import BlockDirectory
from blockd.types import AdmitOp, CommitOp, HostSpec, Namespace, ReleaseOp
from clients.aio_client import AsyncComputedClient
from clients.spawn import start_blockd, start_computed, start_valkey

TITLE = "10. Shared tier: cross-worker TTFT, two-worker hit rate"
PREFIX = 2048
NEW = 64
WORKER_ARGS = ("--max-num-batched-tokens", "4096", "--num-blocks", "400", "--log-format", "json")


def run(ctx: BenchContext) -> BenchResult:
    ttft = _ttft(ctx)
    table, replay = _replay(ctx.quick)
    figures = [
        Figure(
            "TTFT shared tier hit on another worker ÷ recompute, 2K prefix",
            round(ttft["shared"] / ttft["cold"], 4),
            "",
            Goal("<=", 0.2),
        ),
        Figure("two-worker replay hit rate ÷ unbounded, without shared tier", round(replay["off"], 3)),
        Figure("two-worker replay hit rate ÷ unbounded, with shared tier", round(replay["on"], 3)),
    ]
    details = (
        "TTFT (median, ms), 2,048-token prefix + 64 new tokens, two computed `"
        + " ".join(WORKER_ARGS)
        + " --shared-tier redis://...` on one blockd and a local valkey-server:\n\n"
        "| served from | TTFT (ms) | ÷ recompute |\n|---|---|---|\n"
        + "\n".join(
            f"| {name} | {ttft[key] * 1e3:.1f} | {ttft[key] / ttft['cold']:.3f} |"
            for name, key in (("recompute (worker A)", "cold"), ("shared tier (worker B)", "shared"))
        )
        + "\n\n"
        + "\n".join(table)
    )
    return BenchResult("shared", TITLE, figures, details)


def _ttft(ctx: BenchContext) -> dict[str, float]:
    repeats = 1 if ctx.quick else 3
    root = ctx.scratch("shared-ttft")
    env = {"OMP_NUM_THREADS": str(ctx.threads), "MKL_NUM_THREADS": str(ctx.threads)} if ctx.threads else None
    daemons = []
    try:
        valkey = start_valkey(root / "valkey")
        daemons.append(valkey)
        url = f"redis://{valkey.address}"
        blockd = start_blockd(root, "--shared-tier", url, "--log-format", "json", "--lease-ttl", "60")
        daemons.append(blockd)
        workers = []
        for name in ("computed-a", "computed-b"):
            worker = start_computed(
                root, blockd.address, *WORKER_ARGS, "--shared-tier", url, env=env, name=name
            )
            daemons.append(worker)
            workers.append(worker.address)
        samples = asyncio.run(_ttft_samples(workers, repeats))
    finally:
        for daemon in reversed(daemons):
            daemon.stop(timeout=30.0)
    return {key: median(s[key] for s in samples) for key in ("cold", "shared")}


async def _ttft_samples(workers: Sequence[str], repeats: int) -> list[dict[str, float]]:
    rng = random.Random(13)
    samples = []
    async with AsyncComputedClient(workers[0]) as a, AsyncComputedClient(workers[1]) as b:
        for client in (a, b):  # warm-up: the largest shapes
            for prompt in unrelated_prompts(rng.randrange(1 << 30), 1, PREFIX + NEW):
                await generate_one(client, prompt, 1)
        for _ in range(repeats):
            prefix = random_tokens(rng, PREFIX)
            cold = await generate_one(a, prefix + random_tokens(rng, NEW), 1)
            await asyncio.sleep(0.5)  # A's writes reach the store and blockd hears of them
            shared = await generate_one(b, prefix + random_tokens(rng, NEW), 1)
            assert cold.cached_tokens == 0, cold
            assert shared.cached_tokens >= PREFIX, (
                f"worker B did not get the prefix from the shared tier: {shared}"
            )
            samples.append({"cold": cold.ttft_s, "shared": shared.ttft_s})
    return samples


def replay_two_workers(
    trace: Sequence[Sequence[int]], conversations: Sequence[int], num_blocks: int, shared: bool
) -> float:
    """Hit rate of the trace over two pools of one blockd: request i goes to the worker
    of its conversation, every tenth to the other one. Writes to the shared tier are
    reported done at once (the store never loses them)."""
    directory = BlockDirectory(DirectoryConfig(), clock=lambda: 0.0)
    spec = HostSpec(has_shared_tier=shared)
    pools = [
        directory.register_pool(num_blocks, BLOCK_SIZE, Namespace("bench-shared"), f"sim:{i}", host=spec)
        for i in range(2)
    ]
    hits = queried = 0
    for seq_id, (prompt, conversation) in enumerate(zip(trace, conversations)):
        worker = (conversation + (seq_id % 10 == 9)) % 2
        reg = pools[worker]
        result = directory.step(reg.pool_id, reg.epoch, admits=[AdmitOp(seq_id, prompt)]).admits[0]
        assert result.admitted, "one request at a time fits a pool larger than a prompt"
        first = result.num_cached_tokens // BLOCK_SIZE - len(result.shared_loads)
        last = len(prompt) // BLOCK_SIZE
        commits = []
        if last > first:
            table = result.block_ids[first:last]
            commits = [CommitOp(seq_id, table, prompt[first * BLOCK_SIZE : last * BLOCK_SIZE])]
        step = directory.step(reg.pool_id, reg.epoch, commits=commits, releases=[ReleaseOp(seq_id)])
        if step.shared_stores:
            directory.step(reg.pool_id, reg.epoch, shared_written=[s.block_hash for s in step.shared_stores])
        hits += result.num_cached_tokens
        queried += len(prompt)
    return hits / queried


def _replay(quick: bool) -> tuple[list[str], dict[str, float]]:
    spec = ConversationSpec(num_conversations=60 if quick else 160)
    trace = conversation_trace(spec)
    conversations = _conversation_of(trace)
    distinct = num_distinct_blocks(trace)
    largest = max(len(p) for p in trace) // BLOCK_SIZE + 2
    unbounded = replay_tiers(trace, distinct + largest).hit_rate  # one pool that never evicts
    n = max(int(distinct * 0.05), largest)
    off = replay_two_workers(trace, conversations, n, False) / unbounded
    on = replay_two_workers(trace, conversations, n, True) / unbounded
    rows = [
        (
            f"Replay: {len(trace)} requests of the conversation trace, {distinct:,} distinct blocks of "
            f"{BLOCK_SIZE}; two workers with {n:,} device blocks each (5%); one unbounded cache hits "
            f"{unbounded:.3f} of the prompt tokens."
        ),
        "",
        "| setup | hit rate ÷ unbounded |",
        "|---|---|",
        f"| two workers, device pools only | {off:.3f} |",
        f"| two workers + shared tier | {on:.3f} |",
    ]
    return rows, {"off": off, "on": on}


def _conversation_of(trace: Sequence[Sequence[int]]) -> list[int]:
    """A worker per request: requests sharing their first block are one conversation
    (or one family), so they go to the same worker, as a cache-aware router sends them."""
    worker_of: dict[tuple[int, ...], int] = {}
    workers = []
    for prompt in trace:
        head = tuple(prompt[:BLOCK_SIZE])
        workers.append(worker_of.setdefault(head, len(worker_of) % 2))
    return workers
