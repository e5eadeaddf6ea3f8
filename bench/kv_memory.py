"""7. KV memory: 100 live requests sharing 1,024 tokens hold each shared block once.

The first request is admitted and its full blocks committed (as computed commits them
after its prefill); then the other 99 are admitted in one Step; nothing is released.
Blocks referenced (the pool's stats) ÷ the ideal: the 64 shared blocks once plus each
request's private blocks, ceil((1024 + u) / 16) - 64 for u unique tokens. Measured in
the directory core and through a real blockd over gRPC (the Step a worker sends).
A third, informative case admits all 100 in the same Step before anything is committed
(a cold burst): nothing can be shared yet, which is what computed avoids by committing
a prefix before the requests that arrive behind it are admitted.
"""

from __future__ import annotations

import random

import grpc

from bench.context import BenchContext
from bench.report import BenchResult, Figure, Goal
from blockd.directory import BlockDirectory
from blockd.types import AdmitOp, CommitOp, Namespace
from clients.spawn import start_blockd
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc

TITLE = "7. KV memory"

SHARED = 1024
BLOCK_SIZE = 16
NUM_REQUESTS = 100
POOL_BLOCKS = 16_384


def run(ctx: BenchContext) -> BenchResult:
    prompts = _prompts(seed=7)
    ideal = SHARED // BLOCK_SIZE + sum(_num_blocks(len(p)) - SHARED // BLOCK_SIZE for p in prompts)
    core = _core(prompts, primed=True)
    burst = _core(prompts, primed=False)
    over_grpc = _grpc(ctx, prompts)
    figures = [
        Figure("blocks referenced ÷ ideal (directory core)", round(core / ideal, 4), "", Goal("==", 1.0)),
        Figure(
            "blocks referenced ÷ ideal (blockd over gRPC)", round(over_grpc / ideal, 4), "", Goal("==", 1.0)
        ),
        Figure("blocks referenced ÷ ideal (cold burst, informative)", round(burst / ideal, 2)),
    ]
    naive = sum(_num_blocks(len(p)) for p in prompts)
    details = (
        f"{NUM_REQUESTS} live requests: {SHARED} shared tokens + 4-24 unique tokens each (seeded), block "
        f"size {BLOCK_SIZE}, pool {POOL_BLOCKS:,} blocks.\n\n"
        "| case | blocks referenced | ideal | without sharing |\n|---|---|---|---|\n"
        f"| directory core | {core:,} | {ideal:,} | {naive:,} |\n"
        f"| blockd over gRPC | {over_grpc:,} | {ideal:,} | {naive:,} |\n"
        f"| cold burst (one Step, nothing committed yet) | {burst:,} | {ideal:,} | {naive:,} |"
    )
    return BenchResult("kv_memory", TITLE, figures, details)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(100_000) for _ in range(SHARED)]
    return [shared + [rng.randrange(100_000) for _ in range(rng.randint(4, 24))] for _ in range(NUM_REQUESTS)]


def _num_blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def _core(prompts: list[list[int]], primed: bool) -> int:
    directory = BlockDirectory(clock=lambda: 0.0)
    reg = directory.register_pool(POOL_BLOCKS, BLOCK_SIZE, Namespace("bench-memory"), "sim:0")
    pool, epoch = reg.pool_id, reg.epoch
    rest = prompts
    if primed:
        first = directory.step(pool, epoch, admits=[AdmitOp(0, prompts[0])]).admits[0]
        full = len(prompts[0]) // BLOCK_SIZE
        directory.step(
            pool, epoch, commits=[CommitOp(0, first.block_ids[:full], prompts[0][: full * BLOCK_SIZE])]
        )
        rest = prompts[1:]
    offset = len(prompts) - len(rest)
    result = directory.step(pool, epoch, admits=[AdmitOp(offset + i, p) for i, p in enumerate(rest)])
    assert all(a.admitted for a in result.admits), "the pool holds every request"
    stats = directory.stats(pool).total
    assert stats.num_sequences == NUM_REQUESTS, "every request is live"
    return stats.num_referenced_blocks


def _grpc(ctx: BenchContext, prompts: list[list[int]]) -> int:
    daemon = start_blockd(ctx.scratch("kv_memory"), "--log-format", "json")
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.BlockDirectoryServiceStub(channel)
            reg = stub.RegisterPool(
                pb.RegisterPoolRequest(
                    num_blocks=POOL_BLOCKS,
                    block_size=BLOCK_SIZE,
                    namespace=pb.Namespace(model_id="bench-memory"),
                )
            )
            step = pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch)
            step.admits.add(sequence_id=0, token_ids=prompts[0])
            first = stub.Step(step).admits[0]
            full = len(prompts[0]) // BLOCK_SIZE
            step = pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch)
            step.commits.add(
                sequence_id=0, block_ids=first.block_ids[:full], token_ids=prompts[0][: full * BLOCK_SIZE]
            )
            for i, prompt in enumerate(prompts[1:], start=1):
                step.admits.add(sequence_id=i, token_ids=prompt)
            reply = stub.Step(step)
            assert all(a.admitted for a in reply.admits), "the pool holds every request"
            stats = pb_grpc.DirectoryAdminServiceStub(channel).GetStats(
                pb.GetStatsRequest(pool_id=reg.pool_id)
            )
            assert stats.total.num_sequences == NUM_REQUESTS, "every request is live"
            return stats.total.num_referenced_blocks
    finally:
        daemon.stop()
