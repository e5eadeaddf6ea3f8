"""blockd's CPU per admission of the capacity bench, in process (no gRPC, no event loop).

Replays the Steps of `bench.blockd_grpc`'s batched workers (its `StepWriter`, packed
wire form: each Step commits and releases the previous Step's 4 admissions and admits
4 new 4,096-token prompts, a 2,048-token shared prefix + a unique 2,048-token suffix)
through the servicer's Step path: parse the StepStreamRequest bytes, `_step`, serialise
the StepStreamResponse, as blockd does for each request on a StepStream. Once the pools
are full, each admission hits 128 blocks, commits 128 new ones and evicts 128.

What it prints is blockd's own CPU per admission (`time.process_time` around the server
side only; writing the requests is the client's and is left out), best of `--rounds`
rounds after a warm-up that fills every pool, for each build of the directory core in
its own processes, in turns of both orders: compiled (blockd.native, what the daemon runs
where `make native` built it) and pure. The gRPC transport adds ~105 us of server CPU per
Step on top (bench.blockd_grpc's echo server). `--profile` prints cProfile's top entries
of one more round of the pure core in this process (cProfile does not see compiled
functions: for those, `py-spy record --native`).

    python -m bench.blockd_inprocess [--rounds 5] [--steps 200] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time

from bench import core_builds
from bench.blockd_grpc import (
    ADMITS_PER_STEP,
    BLOCK_SIZE,
    NUM_WORKERS,
    POOL_BLOCKS,
    Prompts,
    StepWriter,
    _field,
)
from blockd.auth import BearerAuth
from blockd.config import DirectoryConfig
from blockd.directory import BlockDirectory
from blockd.server import GC_THRESHOLDS
from blockd.service import BlockDirectoryService
from blockd.types import Namespace
from kvcache.v1 import directory_pb2 as pb

WIRE = "packed"  # the form computed and bench.blockd_grpc's batched workers send
WARMUP_STEPS = 40  # per worker: 160 admissions of 128 new blocks fill a 4,096-block pool 5x


class Worker:
    """One simulated worker: its pool, its StepWriter and the admissions it runs."""

    def __init__(self, directory: BlockDirectory, index: int) -> None:
        reg = directory.register_pool(POOL_BLOCKS, BLOCK_SIZE, Namespace("bench"), f"bench:{index}")
        pool = pb.RegisterPoolResponse(pool_id=reg.pool_id, epoch=reg.epoch)
        self.writer = StepWriter(pool, Prompts(index, WIRE), WIRE)
        self.running: list[tuple[int, list[bytes], pb.AdmitResult]] = []

    def next_request(self) -> tuple[bytes, list]:
        request, admits = self.writer.write(self.running)
        return _field(0x0A, request), admits

    def answered(self, admits: list, reply: pb.StepResponse) -> int:
        self.running = [
            (sequence_id, blocks, result)
            for (sequence_id, blocks), result in zip(admits, reply.admits)
            if result.admitted
        ]
        return len(self.running)


class Replay:
    """NUM_WORKERS workers' Steps, round robin, through one servicer."""

    def __init__(self) -> None:
        self.directory = BlockDirectory(DirectoryConfig(lease_ttl_seconds=86_400))
        self.service = BlockDirectoryService(self.directory, BearerAuth(None, "worker", "--worker-token"))
        self.workers = [Worker(self.directory, i) for i in range(NUM_WORKERS)]

    def run(self, steps: int) -> tuple[float, int]:
        """Server CPU seconds and admissions of `steps` Steps per worker."""
        parse = pb.StepStreamRequest.FromString
        serve = self.service._step
        wrap = pb.StepStreamResponse
        clock = time.process_time
        cpu, admitted = 0.0, 0
        for _ in range(steps):
            for worker in self.workers:
                data, admits = worker.next_request()
                start = clock()
                answer = wrap()  # as the servicer's StepStream: the answer filled in place
                reply = serve(parse(data).step, answer.step)
                answer.SerializeToString()
                cpu += clock() - start
                admitted += worker.answered(admits, reply)
        return cpu, admitted


def measure(rounds: int, steps: int, profile: bool = False) -> dict:
    replay = Replay()
    replay.run(WARMUP_STEPS)
    # As the daemon does after start (blockd.server): long-lived state out of the collector.
    # Restored after: `python -m bench` runs other benchmarks in this process.
    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(*GC_THRESHOLDS)
    gc.freeze()
    try:
        per_admission = []
        for _ in range(rounds):
            cpu, admitted = replay.run(steps)
            assert admitted == steps * NUM_WORKERS * ADMITS_PER_STEP, "every admission fits a full pool"
            per_admission.append(cpu / admitted * 1e6)
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    stats = replay.directory.stats()
    figures = {
        "cpu_us_per_admission": round(min(per_admission), 1),
        "cpu_us_per_admission_rounds": [round(x, 1) for x in per_admission],
        "admissions_per_cpu_second": round(1e6 / min(per_admission)),
        "evictions_per_admission": round(stats.total.num_evictions / max(1, stats.total.num_admissions), 1),
        "hit_rate_tokens": round(stats.total.hit_tokens / max(1, stats.total.queried_tokens), 3),
    }
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        replay.run(steps)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return figures


def main(quick: bool = False, rounds: int = 5, steps: int = 100, profile: bool = False) -> dict:
    """The compiled core (what the daemon runs where built) and the pure one, each in its own
    process, in turns of both orders; without a current build (make native), pure alone."""
    if quick:
        rounds, steps = 2, 25
    if profile:
        return measure(rounds, steps, profile)
    builds = core_builds.builds()
    runs: dict[str, list[dict]] = {build: [] for build in builds}
    for order in (builds, builds[::-1]):
        for build in order:
            runs[build].append(
                core_builds.in_child(build, "bench.blockd_inprocess", f"measure({rounds}, {steps})")
            )
    best = {build: min(found, key=lambda f: f["cpu_us_per_admission"]) for build, found in runs.items()}
    figures = dict(best[builds[0]])
    figures["core"] = builds[0]
    if "compiled" in best:
        figures["pure_cpu_us_per_admission"] = best["pure"]["cpu_us_per_admission"]
        figures["pure_over_compiled_cpu"] = round(
            best["pure"]["cpu_us_per_admission"] / best["compiled"]["cpu_us_per_admission"], 2
        )
    print(
        f"blockd Step path in process ({NUM_WORKERS} pools x {POOL_BLOCKS} blocks, {ADMITS_PER_STEP} "
        f"admissions per Step, {steps} Steps per pool per round, best of {rounds} in each of 2 processes), "
        f"{builds[0]} core: {figures['cpu_us_per_admission']} us CPU per admission "
        f"({figures['admissions_per_cpu_second']} admissions per CPU second); "
        f"{figures['evictions_per_admission']} evictions per admission, hit rate {figures['hit_rate_tokens']}"
    )
    if "compiled" in best:
        print(
            f"  pure core: {figures['pure_cpu_us_per_admission']} us CPU per admission "
            f"(pure / compiled = {figures['pure_over_compiled_cpu']})"
        )
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100, help="Steps per worker per round")
    parser.add_argument(
        "--profile", action="store_true", help="print cProfile's top entries of one more round"
    )
    args = parser.parse_args()
    main(False, args.rounds, args.steps, args.profile)
