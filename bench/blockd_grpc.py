"""blockd over gRPC: 8 concurrent workers, batched Steps versus one call per block.

Starts a real blockd (subprocess). Each worker registers its own pool and loops:
one Step per scheduler step that commits the full blocks of the previous step's
admissions, releases them, and admits `ADMITS_PER_STEP` new 4,096-token prompts
(a shared 2,048-token system prefix + a unique 2,048-token suffix). The naive
client does the same work with one Step per block: admit the first block, then grow
and commit block by block, then release. Both run in this same process and run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
NUM_WORKERS = 8
ADMITS_PER_STEP = 4
PROMPT_TOKENS = 4096
SHARED_PREFIX = 2048
BLOCK_SIZE = 16
POOL_BLOCKS = 4096
SYSTEM_PROMPT = [random.Random(1).randrange(128_000) for _ in range(SHARED_PREFIX)]


def start_blockd(workdir: Path) -> tuple[subprocess.Popen, str]:
    ready = workdir / "blockd.ready"
    with open(workdir / "blockd.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "blockd",
                "--listen",
                "127.0.0.1:0",
                "--ready-file",
                str(ready),
                "--lease-ttl",
                "60",
                "--log-format",
                "json",
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while not (ready.exists() and ready.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"blockd did not start: {(workdir / 'blockd.log').read_text()}")
        time.sleep(0.05)
    return proc, ready.read_text().strip()


class Prompts:
    """Shared system prefix + a unique suffix; suffixes are drawn once and made unique by
    a counter, so the client spends its CPU on calls, not on random numbers."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self._suffixes = [
            [rng.randrange(128_000) for _ in range(PROMPT_TOKENS - SHARED_PREFIX)] for _ in range(8)
        ]
        self._count = 0

    def next(self) -> list[int]:
        self._count += 1
        suffix = self._suffixes[self._count % len(self._suffixes)]
        return SYSTEM_PROMPT + [200_000 + self._count] + suffix[1:]


async def batched_worker(address: str, index: int, stop_at: float, latencies: list[float]) -> int:
    """Answers how many sequences it admitted."""
    prompts_of = Prompts(index)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.BlockDirectoryServiceStub(channel)
        pool = await stub.RegisterPool(
            pb.RegisterPoolRequest(
                num_blocks=POOL_BLOCKS, block_size=BLOCK_SIZE, namespace=pb.Namespace(model_id="bench")
            )
        )
        running: list[tuple[int, list[int], pb.AdmitResult]] = []
        next_id, admitted = 0, 0
        while time.monotonic() < stop_at:
            request = pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch)
            for sequence_id, tokens, result in running:
                first = result.num_cached_tokens // BLOCK_SIZE
                request.commits.add(
                    sequence_id=sequence_id,
                    block_ids=result.block_ids[first:],
                    token_ids=tokens[first * BLOCK_SIZE :],
                )
                request.releases.add(sequence_id=sequence_id)
            prompts = []
            for _ in range(ADMITS_PER_STEP):
                tokens = prompts_of.next()
                prompts.append((next_id, tokens))
                request.admits.add(sequence_id=next_id, token_ids=tokens)
                next_id += 1
            start = time.perf_counter()
            reply = await stub.Step(request)
            latencies.append(time.perf_counter() - start)
            running = [
                (sid, tokens, result)
                for (sid, tokens), result in zip(prompts, reply.admits)
                if result.admitted
            ]
            admitted += len(running)
        return admitted


async def naive_worker(address: str, index: int, stop_at: float) -> int:
    """The same work, one Step per block."""
    prompts_of = Prompts(1000 + index)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.BlockDirectoryServiceStub(channel)
        pool = await stub.RegisterPool(
            pb.RegisterPoolRequest(
                num_blocks=POOL_BLOCKS, block_size=BLOCK_SIZE, namespace=pb.Namespace(model_id="bench")
            )
        )
        sequence_id, admitted = 0, 0
        while time.monotonic() < stop_at:
            sequence_id += 1
            tokens = prompts_of.next()
            step = lambda **ops: stub.Step(pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch, **ops))
            reply = await step(admits=[pb.AdmitOp(sequence_id=sequence_id, token_ids=tokens[:BLOCK_SIZE])])
            table = list(reply.admits[0].block_ids)
            committed = reply.admits[0].num_cached_tokens // BLOCK_SIZE
            for block in range(1, PROMPT_TOKENS // BLOCK_SIZE + 1):
                grows = (
                    [pb.GrowOp(sequence_id=sequence_id, num_tokens=(block + 1) * BLOCK_SIZE)]
                    if block < PROMPT_TOKENS // BLOCK_SIZE
                    else []
                )
                commits = (
                    []
                    if committed >= block
                    else [
                        pb.CommitOp(
                            sequence_id=sequence_id,
                            block_ids=table[block - 1 : block],
                            token_ids=tokens[(block - 1) * BLOCK_SIZE : block * BLOCK_SIZE],
                        )
                    ]
                )
                reply = await step(grows=grows, commits=commits)
                if grows:
                    table += reply.grows[0].new_block_ids
            await step(releases=[pb.ReleaseOp(sequence_id=sequence_id)])
            admitted += 1
        return admitted


async def run(address: str, seconds: float) -> dict:
    latencies: list[float] = []
    start = time.monotonic()
    counts = await asyncio.gather(
        *(batched_worker(address, i, start + seconds, latencies) for i in range(NUM_WORKERS))
    )
    batched_s = time.monotonic() - start
    start = time.monotonic()
    naive = await asyncio.gather(*(naive_worker(address, i, start + seconds) for i in range(NUM_WORKERS)))
    naive_s = time.monotonic() - start
    async with grpc.aio.insecure_channel(address) as channel:
        stats = await pb_grpc.DirectoryAdminServiceStub(channel).GetStats(pb.GetStatsRequest())
    quantiles = statistics.quantiles(latencies, n=100)
    return {
        "workers": NUM_WORKERS,
        "admits_per_step": ADMITS_PER_STEP,
        "batched_admissions_per_s": round(sum(counts) / batched_s, 1),
        "batched_tokens_per_s": round(sum(counts) * PROMPT_TOKENS / batched_s),
        "step_p50_ms": round(statistics.median(latencies) * 1e3, 2),
        "step_p99_ms": round(quantiles[98] * 1e3, 2),
        "naive_admissions_per_s": round(sum(naive) / naive_s, 2),
        "hit_rate_tokens": round(stats.total.hit_tokens / max(1, stats.total.queried_tokens), 3),
    }


def main(quick: bool = False) -> dict:
    seconds = 3.0 if quick else 15.0
    with tempfile.TemporaryDirectory() as workdir:
        proc, address = start_blockd(Path(workdir))
        try:
            figures = asyncio.run(run(address, seconds))
        finally:
            proc.terminate()
            exit_code = proc.wait(30)
    figures["batched_over_naive"] = round(
        figures["batched_admissions_per_s"] / max(figures["naive_admissions_per_s"], 1e-9), 1
    )
    figures["blockd_exit_code"] = exit_code
    print(
        f"blockd over gRPC, {NUM_WORKERS} workers x {seconds:.0f} s each mode, {PROMPT_TOKENS}-token prompts "
        f"({SHARED_PREFIX} shared), {os.cpu_count()} CPUs:"
    )
    print(
        f"  batched: {figures['batched_admissions_per_s']} admissions/s "
        f"({ADMITS_PER_STEP} admits + commits + releases per Step), "
        f"Step p50 {figures['step_p50_ms']} ms, p99 {figures['step_p99_ms']} ms"
    )
    print(f"  naive (one Step per block): {figures['naive_admissions_per_s']} admissions/s")
    print(
        f"  batched / naive = {figures['batched_over_naive']}x; prefix hit rate {figures['hit_rate_tokens']}"
    )
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s per mode instead of 15 s")
    main(parser.parse_args().quick)
