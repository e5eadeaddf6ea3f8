"""blockd as a fleet's control plane: 64 simulated GPU workers, one process against shards.

Each simulated worker registers a pool and sends Steps as a GPU worker running
nano-vllm's workload does: `STEPS_PER_S` Steps a second carrying `ADMITS_PER_S`
admissions a second between them (prompts of 128..1,024 tokens, the first 256 shared
by the 8 apps of the fleet, sent packed), the commits of each admission's prefill by
block index in the next Step, a grow whenever a decoding sequence starts a block and
the commit of each block it fills (with its tokens), and the release after 64..256
generated tokens. Workers send their Steps on a `StepStream` each, as computed does; the
one-process runs are repeated with unary `Step` calls to show the stream's gain. The clients run in `CLIENT_PROCESSES` processes (one Python process
cannot write 4,480 Steps a second); workers are assigned to shards round robin.

Two loads, each against one blockd and against `NUM_SHARDS` shards (one process each):
- open loop at the GPU rate: the Step latency a worker sees (p50, p99) from its
  scheduled time (no coordinated omission), and the Steps and admissions served;
- closed loop (each worker's next Step as soon as its last one answered): the maximum
  Steps a second, whose ratio sharded / one process is the scaling figure.

Latencies and rates count the Steps scheduled after `WARMUP_S`: the start (64 workers
registering and opening their streams in the same instant, every worker's running set
still empty) is not the steady state, and against the echo server it alone made the
harness's p99 ~120 ms where the steady state's is ~2 ms. A worker's prompt tokens come
from `random.randbytes` over its app's cached prefix bytes: building them from
per-token `randrange` calls cost the client processes ~0.4 of a core at this rate, CPU
that blockd shares on a 2-core machine.

The client processes run at nice 10: a fleet's workers are other machines, and here
they would take the CPU from the daemon whose latency they measure (p99 3.7-5.1 ms
without, 2.5-3.9 ms with, one blockd; their own delays still count in the latency).

On a machine whose cores the client processes share with blockd (2 cores here), the
figures measure the machine as much as blockd: read them beside `cpu_count` and beside
the same open loop against an echo server that answers at once (the harness's floor).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from bench.blockd_grpc import start_blockd, start_echo
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc
from kvcache_contract.block_hash import token_bytes

NUM_WORKERS = 64
NUM_SHARDS = 2
CLIENT_PROCESSES = 2
STEPS_PER_S = 70.0  # a GPU worker's Steps (nano-vllm's workload at the rate peers reach)
ADMITS_PER_S = 20.0
BLOCK_SIZE = 16
POOL_BLOCKS = 8192
SHARED_PREFIX = 256
NUM_APPS = 8
WARMUP_S = 2.0  # not measured: see the module docstring
CLIENT_NICE = 10  # the load generator yields the CPU to the daemons it measures (docstring)
STEP_METHOD = "/kvcache.v1.BlockDirectoryService/Step"
STREAM_METHOD = "/kvcache.v1.BlockDirectoryService/StepStream"


class Sequence:
    __slots__ = ("block_ids", "num_committed", "num_left", "num_prompt", "num_tokens", "prompt")

    def __init__(self, block_ids: list[int], prompt: bytes, num_cached: int, num_out: int) -> None:
        self.block_ids = block_ids
        self.prompt = prompt  # packed, as admitted
        self.num_prompt = num_prompt = len(prompt) // 4
        self.num_tokens = num_prompt
        self.num_left = num_out
        self.num_committed = num_cached // BLOCK_SIZE


class SimulatedWorker:
    """One GPU worker's Steps (see the module docstring); `next_step` writes one."""

    def __init__(self, index: int, pool: pb.RegisterPoolResponse) -> None:
        self.pool = pool
        self.rng = random.Random(index)
        self.apps = [  # packed, as sent
            token_bytes([random.Random(app).randrange(128_000) for _ in range(SHARED_PREFIX)])
            for app in range(NUM_APPS)
        ]
        self.running: dict[int, Sequence] = {}
        self.admitting: dict[int, tuple[bytes, int]] = {}  # sequence id -> (packed prompt, output tokens)
        self.next_id = 0
        self.admit_credit = 0.0
        self.num_admitted = 0

    def next_step(self) -> pb.StepRequest:
        request = pb.StepRequest(pool_id=self.pool.pool_id, epoch=self.pool.epoch)
        for sequence_id, seq in list(self.running.items()):
            full = seq.num_tokens // BLOCK_SIZE
            if full > seq.num_committed:  # prefill by index, a decoded block with its tokens
                ids = seq.block_ids[seq.num_committed : full]
                if full * BLOCK_SIZE <= seq.num_prompt:
                    request.commits.add(sequence_id=sequence_id, block_ids=ids)
                else:
                    decoded = token_bytes(
                        [sequence_id % 50_000 + t for t in range(seq.num_prompt, full * BLOCK_SIZE)]
                    )
                    data = (seq.prompt + decoded)[seq.num_committed * BLOCK_SIZE * 4 :]
                    request.commits.add(sequence_id=sequence_id, block_ids=ids, token_bytes=data)
                seq.num_committed = full
            if seq.num_left == 0:
                request.releases.add(sequence_id=sequence_id)
                del self.running[sequence_id]
                continue
            seq.num_tokens += 1  # this step decodes one token
            seq.num_left -= 1
            if seq.num_tokens > len(seq.block_ids) * BLOCK_SIZE:
                request.grows.add(sequence_id=sequence_id, num_tokens=seq.num_tokens)
        self.admit_credit += ADMITS_PER_S / STEPS_PER_S
        while self.admit_credit >= 1.0:
            self.admit_credit -= 1.0
            sequence_id, self.next_id = self.next_id, self.next_id + 1
            num_prompt = self.rng.randrange(128, 1025)
            num_shared = min(SHARED_PREFIX, num_prompt)
            packed = self.apps[self.rng.randrange(NUM_APPS)][: num_shared * 4]
            packed += self.rng.randbytes(4 * (num_prompt - num_shared))  # any u32 is a token id here
            request.admits.add(sequence_id=sequence_id, token_bytes=packed)
            self.admitting[sequence_id] = (packed, self.rng.randrange(64, 257))
        return request

    def take(self, request: pb.StepRequest, reply: pb.StepResponse) -> None:
        for grow in reply.grows:
            seq = self.running.get(grow.sequence_id)
            if seq is not None:
                seq.block_ids.extend(grow.new_block_ids)
                if not grow.grown:  # no block now: this token waits for the next step
                    seq.num_tokens -= 1
                    seq.num_left += 1
        for admit in reply.admits:
            prompt, num_out = self.admitting.pop(admit.sequence_id)
            if admit.admitted:
                self.running[admit.sequence_id] = Sequence(
                    list(admit.block_ids), prompt, admit.num_cached_tokens, num_out
                )
                self.num_admitted += 1


async def _worker(
    address: str,
    index: int,
    measure_from: float,
    stop_at: float,
    period: float | None,
    latencies: list,
    stream: bool,
) -> tuple:
    """Runs one simulated worker until `stop_at` (time.monotonic); answers (Steps, admissions)
    counted from `measure_from`, whose Steps' latencies it appends to `latencies`."""
    async with grpc.aio.insecure_channel(address) as channel:
        pool = await pb_grpc.BlockDirectoryServiceStub(channel).RegisterPool(
            pb.RegisterPoolRequest(
                num_blocks=POOL_BLOCKS,
                block_size=BLOCK_SIZE,
                namespace=pb.Namespace(model_id="fleet"),
                worker_address=f"gpu-{index}:1",
            )
        )
        if stream:
            call = channel.stream_stream(
                STREAM_METHOD,
                request_serializer=pb.StepStreamRequest.SerializeToString,
                response_deserializer=pb.StepStreamResponse.FromString,
            )()

            async def step(request: pb.StepRequest) -> pb.StepResponse:
                await call.write(pb.StepStreamRequest(step=request))
                return (await call.read()).step
        else:
            step = channel.unary_unary(
                STEP_METHOD,
                request_serializer=pb.StepRequest.SerializeToString,
                response_deserializer=pb.StepResponse.FromString,
            )
        worker = SimulatedWorker(index, pool)
        num_steps = num_admitted = 0
        scheduled = time.perf_counter() + (random.Random(index).random() * period if period else 0.0)
        while time.monotonic() < stop_at:
            request = worker.next_step()
            start = time.perf_counter()
            if period is not None:
                if start < scheduled:
                    await asyncio.sleep(scheduled - start)
                    start = time.perf_counter()
                else:
                    start = scheduled  # late because the last Step was: that wait counts
                scheduled += period
            before = worker.num_admitted
            reply = await step(request)
            latency = time.perf_counter() - start
            worker.take(request, reply)
            if time.monotonic() >= measure_from:
                latencies.append(latency)
                num_steps += 1
                num_admitted += worker.num_admitted - before
        if stream:
            await call.done_writing()
        return num_steps, num_admitted


def _client_process(
    addresses: list[str], indexes: list[int], seconds: float, period: float | None, stream: bool, out
) -> None:
    os.nice(CLIENT_NICE)

    async def run() -> tuple:
        latencies: list[float] = []
        measure_from = time.monotonic() + WARMUP_S
        counts = await asyncio.gather(
            *(
                _worker(
                    addresses[i % len(addresses)],
                    i,
                    measure_from,
                    measure_from + seconds,
                    period,
                    latencies,
                    stream,
                )
                for i in indexes
            )
        )
        return (
            sum(c[0] for c in counts),
            sum(c[1] for c in counts),
            latencies,
            time.monotonic() - measure_from,
        )

    out.put(asyncio.run(run()))


def _load(addresses: list[str], seconds: float, period: float | None, stream: bool = True) -> dict:
    context = mp.get_context("spawn")
    out = context.Queue()
    groups = [list(range(p, NUM_WORKERS, CLIENT_PROCESSES)) for p in range(CLIENT_PROCESSES)]
    procs = [
        context.Process(target=_client_process, args=(addresses, g, seconds, period, stream, out))
        for g in groups
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=WARMUP_S + seconds + 120) for _ in procs]
    for proc in procs:
        proc.join(30)
    steps = sum(r[0] for r in results)
    admitted = sum(r[1] for r in results)
    latencies = [x for r in results for x in r[2]]
    wall = max(r[3] for r in results)
    quantiles = statistics.quantiles(latencies, n=100)
    return {
        "steps_per_s": round(steps / wall, 1),
        "admissions_per_s": round(admitted / wall, 1),
        "step_p50_ms": round(quantiles[49] * 1e3, 2),
        "step_p99_ms": round(quantiles[98] * 1e3, 2),
    }


def main(quick: bool = False) -> dict:
    seconds = 4.0 if quick else 12.0
    figures: dict = {"workers": NUM_WORKERS, "shards": NUM_SHARDS, "cpu_count": os.cpu_count()}
    offered = NUM_WORKERS * STEPS_PER_S
    figures["offered_steps_per_s"] = offered
    figures["offered_admissions_per_s"] = NUM_WORKERS * ADMITS_PER_S
    with tempfile.TemporaryDirectory() as workdir:
        setups = {"one": 1, "sharded": NUM_SHARDS}
        for name, count in setups.items():
            for i in range(count):
                (Path(workdir) / f"{name}{i}").mkdir()
            daemons = [start_blockd(Path(workdir) / f"{name}{i}") for i in range(count)]
            addresses = [address for _, address in daemons]
            try:
                for mode, period in (("open", 1.0 / STEPS_PER_S), ("closed", None)):
                    for key, value in _load(addresses, seconds, period).items():
                        figures[f"{name}_{mode}_{key}"] = value
                    if name == "one":  # the same load as unary Step calls, for the stream's gain
                        for key, value in _load(addresses, seconds, period, stream=False).items():
                            figures[f"unary_{mode}_{key}"] = value
            finally:
                for proc, _ in daemons:
                    proc.terminate()
                    proc.wait(30)
        # The harness's own floor: the same open loop against a server that answers at once
        # (bench.blockd_grpc's echo server), on the same cores.
        echo, echo_address = start_echo(Path(workdir))
        try:
            for key, value in _load([echo_address], seconds, 1.0 / STEPS_PER_S).items():
                figures[f"echo_open_{key}"] = value
        finally:
            echo.terminate()
            echo.wait(30)
    figures["stream_over_unary_closed_steps"] = round(
        figures["one_closed_steps_per_s"] / figures["unary_closed_steps_per_s"], 2
    )
    figures["sharded_over_one_closed_steps"] = round(
        figures["sharded_closed_steps_per_s"] / figures["one_closed_steps_per_s"], 2
    )
    print(
        f"blockd fleet: {NUM_WORKERS} simulated GPU workers ({STEPS_PER_S:.0f} Steps/s, {ADMITS_PER_S:.0f} "
        f"admissions/s each: {offered:.0f} Steps/s offered), {seconds:.0f} s per run, {os.cpu_count()} CPUs"
    )
    for name in setups:
        print(
            f"  {name}: open loop served {figures[f'{name}_open_steps_per_s']} Steps/s "
            f"({figures[f'{name}_open_admissions_per_s']} admissions/s), Step p50 "
            f"{figures[f'{name}_open_step_p50_ms']} ms, p99 {figures[f'{name}_open_step_p99_ms']} ms; "
            f"closed loop {figures[f'{name}_closed_steps_per_s']} Steps/s"
        )
    print(
        f"  one blockd, unary Step calls instead of StepStream: open loop Step p99 "
        f"{figures['unary_open_step_p99_ms']} ms, closed loop {figures['unary_closed_steps_per_s']} Steps/s "
        f"(stream / unary = {figures['stream_over_unary_closed_steps']}x)"
    )
    print(f"  sharded / one (closed loop Steps/s) = {figures['sharded_over_one_closed_steps']}x")
    print(
        f"  echo server (answers at once; the clients and the machine alone): open loop Step p50 "
        f"{figures['echo_open_step_p50_ms']} ms, p99 {figures['echo_open_step_p99_ms']} ms"
    )
    return figures


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 s per run instead of 12 s")
    main(parser.parse_args().quick)
