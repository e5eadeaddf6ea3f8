"""blockd over gRPC: 8 concurrent workers, batched Steps versus one call per block.

Starts a real blockd (subprocess). Each worker registers its own pool and loops:
one Step per scheduler step that commits the full blocks of the previous step's
admissions, releases them, and admits `ADMITS_PER_STEP` new 4,096-token prompts
(a shared 2,048-token system prefix + a unique 2,048-token suffix). Three modes:

- closed loop: every worker sends its next Step as soon as the last one answered;
  the admissions per second are blockd's maximum, the latencies mostly queueing;
- open loop: the same workers send at a fixed offered rate, half of that maximum,
  evenly spread; a Step's latency counts from its scheduled time when the worker was
  still waiting for its previous answer then (no coordinated omission);
- naive: the same work with one Step per block (admit the first block, then grow and
  commit block by block, then release).

Side by side, the same closed loop runs against an echo server (this module with
--echo: it parses each Step as blockd does and answers at once, every prompt admitted
with half its blocks cached): the ceiling that gRPC, the client and the machine allow,
so `batched_over_ceiling` says how close blockd's own work lets it come.

The batched workers send their Steps on a StepStream each, as computed does, and the
contract's cheap wire forms (prompts as packed
`token_bytes`, commits by block index without tokens); the closed loop also runs with
the old forms (varint `token_ids`, commits resending their tokens), interleaved, and
reports the ratio. The batched workers write their requests with `StepWriter` (cached wire bytes of the
prompts' blocks) rather than building protobuf messages from 24K-int lists per Step:
building them, the client alone capped this benchmark at ~1,400 admissions/s on a
2-core machine (measured against a server that answers at once). The bytes on the
wire are the same Step requests; `StepWriter.check` parses them back to prove it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
OPEN_LOOP_LOAD = 0.5  # offered rate, as a share of the closed-loop maximum
STREAM_METHOD = "/kvcache.v1.BlockDirectoryService/StepStream"
SYSTEM_PROMPT = [random.Random(1).randrange(128_000) for _ in range(SHARED_PREFIX)]


def start_blockd(
    workdir: Path, name: str = "blockd", tree: Path = REPO, native: str | None = None
) -> tuple[subprocess.Popen, str]:
    """A blockd run from `tree` (its own blockd package and generated code); `native`:
    its BLOCKD_NATIVE (blockd.native; None: the environment's, else auto)."""
    args = ["-m", "blockd", "--listen", "127.0.0.1:0", "--lease-ttl", "60", "--log-format", "json"]
    env = None if native is None else {**os.environ, "BLOCKD_NATIVE": native}
    return _start(workdir, name, args, tree, env)


def is_compiled(workdir: Path, name: str = "blockd") -> bool:
    """Whether that blockd runs the compiled directory core (its start-up log says)."""
    for line in (workdir / f"{name}.log").read_text().splitlines():
        if '"directory core"' in line:
            return json.loads(line)["compiled"]
    return False


def start_echo(workdir: Path) -> tuple[subprocess.Popen, str]:
    return _start(workdir, "echo", ["-m", "bench.blockd_grpc", "--echo"])


def _start(
    workdir: Path, name: str, args: list[str], tree: Path = REPO, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    ready = workdir / f"{name}.ready"
    with open(workdir / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, *args, "--ready-file", str(ready)],
            cwd=tree,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while not (ready.exists() and ready.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start: {(workdir / f'{name}.log').read_text()}")
        time.sleep(0.05)
    return proc, ready.read_text().strip()


class EchoService(pb_grpc.BlockDirectoryServiceServicer):
    """Answers at once: the transport ceiling (see the module docstring)."""

    async def RegisterPool(self, request: pb.RegisterPoolRequest, context) -> pb.RegisterPoolResponse:
        return pb.RegisterPoolResponse(pool_id="echo", epoch=1, lease_ttl_seconds=60)

    async def StepStream(self, requests, context):
        async for request in requests:
            yield pb.StepStreamResponse(step=await self.Step(request.step, context))

    async def Step(self, request: pb.StepRequest, context) -> pb.StepResponse:
        block_ids = range(PROMPT_TOKENS // BLOCK_SIZE)
        reply = pb.StepResponse()
        for op in request.admits:
            reply.admits.add(
                sequence_id=op.sequence_id,
                admitted=True,
                block_ids=block_ids,
                num_cached_tokens=SHARED_PREFIX,
            )
        return reply


async def serve_echo(ready_file: Path) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
    pb_grpc.add_BlockDirectoryServiceServicer_to_server(EchoService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ready_file.write_text(f"127.0.0.1:{port}\n")
    await server.wait_for_termination()


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _packed(values: list[int]) -> bytes:
    """The payload of a packed repeated uint32 field: the values' varints."""
    return b"".join(map(_varint, values))


def _field(key: int, payload: bytes) -> bytes:
    """A length-delimited field: key byte (field number << 3 | 2), length, payload."""
    return bytes((key,)) + _varint(len(payload)) + payload


def _le(values: list[int]) -> bytes:
    """The payload of a packed `token_bytes` field: uint32 little-endian."""
    return b"".join(v.to_bytes(4, "little") for v in values)


# The two wire forms of a Step's tokens: "varint" (token_ids lists, commits resend their
# tokens) and "packed" (token_bytes, commits by block index without tokens).
ENCODINGS = {"varint": _packed, "packed": _le}
WIRES = tuple(ENCODINGS)


class Prompts:
    """Shared system prefix + a unique suffix; suffixes are drawn once and made unique by
    a counter, so the client spends its CPU on calls, not on random numbers. Besides the
    token lists (`next`), each prompt's blocks are kept as wire bytes of `wire`'s form
    (`next_blocks`), so a Step can be written without converting any token."""

    def __init__(self, seed: int, wire: str = "varint") -> None:
        rng = random.Random(seed)
        encode = self._encode = ENCODINGS[wire]
        self._suffixes = [
            [rng.randrange(128_000) for _ in range(PROMPT_TOKENS - SHARED_PREFIX)] for _ in range(8)
        ]
        self._system = tuple(
            encode(SYSTEM_PROMPT[i : i + BLOCK_SIZE]) for i in range(0, SHARED_PREFIX, BLOCK_SIZE)
        )
        # Block 0 of a suffix starts with the unique token; the rest of it is fixed.
        self._heads = [encode(s[1:BLOCK_SIZE]) for s in self._suffixes]
        self._tails = [
            [encode(s[i : i + BLOCK_SIZE]) for i in range(BLOCK_SIZE, len(s), BLOCK_SIZE)]
            for s in self._suffixes
        ]
        self._count = 0

    def next(self) -> list[int]:
        self._count += 1
        suffix = self._suffixes[self._count % len(self._suffixes)]
        return SYSTEM_PROMPT + [200_000 + self._count] + suffix[1:]

    def next_blocks(self) -> list[bytes]:
        """The next prompt (the one `next` would answer) in wire form, block by block."""
        self._count += 1
        k = self._count % len(self._suffixes)
        return [*self._system, self._encode([200_000 + self._count]) + self._heads[k], *self._tails[k]]


class StepWriter:
    """Writes one worker's StepRequest bytes: commits and releases of the previous
    step's admissions, then new admissions (proto3 wire format, field by field), in
    either wire form (`WIRES`)."""

    def __init__(self, pool: pb.RegisterPoolResponse, prompts: Prompts, wire: str = "varint") -> None:
        self._header = _field(0x0A, pool.pool_id.encode()) + b"\x10" + _varint(pool.epoch)
        self._prompts = prompts
        self._next_id = 0
        self._packed = wire == "packed"
        # AdmitOp.token_ids is field 2, AdmitOp.token_bytes field 5 (both length-delimited)
        self._admit_key = 0x2A if self._packed else 0x12

    def write(self, running: list[tuple[int, list[bytes], pb.AdmitResult]]) -> tuple[bytes, list]:
        """Answers the request and its admissions as (sequence id, blocks) pairs."""
        parts = [self._header]
        for sequence_id, blocks, result in running:
            first = result.num_cached_tokens // BLOCK_SIZE
            ids = pb.CommitOp(sequence_id=sequence_id, block_ids=result.block_ids[first:]).SerializeToString()
            # packed: commit by block index, the tokens are blockd's copy of the prompt
            parts.append(_field(0x1A, ids if self._packed else ids + _field(0x1A, b"".join(blocks[first:]))))
        for sequence_id, _, _ in running:
            parts.append(_field(0x22, b"\x08" + _varint(sequence_id)))
        admits = []
        for _ in range(ADMITS_PER_STEP):
            sequence_id, self._next_id = self._next_id, self._next_id + 1
            blocks = self._prompts.next_blocks()
            admits.append((sequence_id, blocks))
            parts.append(
                _field(0x32, b"\x08" + _varint(sequence_id) + _field(self._admit_key, b"".join(blocks)))
            )
        return b"".join(parts), admits

    @staticmethod
    def check() -> None:
        """The written bytes parse to the message protobuf would build from token lists."""
        for wire in WIRES:
            pool = pb.RegisterPoolResponse(pool_id="pool-check", epoch=1_700_000_000_123)
            writer, lists = StepWriter(pool, Prompts(7, wire), wire), Prompts(7)
            admitted = pb.AdmitResult(
                sequence_id=0, admitted=True, block_ids=range(256), num_cached_tokens=2048
            )
            _, admits = writer.write([])
            data, _ = writer.write([(admits[0][0], admits[0][1], admitted)])
            expected = pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch)
            first_prompts = [lists.next() for _ in range(ADMITS_PER_STEP)]
            commit = expected.commits.add(sequence_id=0, block_ids=range(128, 256))
            if wire == "varint":
                commit.token_ids.extend(first_prompts[0][2048:])
            expected.releases.add(sequence_id=0)
            for sequence_id in range(ADMITS_PER_STEP, 2 * ADMITS_PER_STEP):
                tokens = lists.next()
                if wire == "packed":
                    expected.admits.add(sequence_id=sequence_id, token_bytes=_le(tokens))
                else:
                    expected.admits.add(sequence_id=sequence_id, token_ids=tokens)
            assert pb.StepRequest.FromString(data) == expected, f"StepWriter wrote another {wire} request"


async def _register(channel: grpc.aio.Channel) -> pb.RegisterPoolResponse:
    stub = pb_grpc.BlockDirectoryServiceStub(channel)
    return await stub.RegisterPool(
        pb.RegisterPoolRequest(
            num_blocks=POOL_BLOCKS, block_size=BLOCK_SIZE, namespace=pb.Namespace(model_id="bench")
        )
    )


async def batched_worker(
    address: str,
    index: int,
    stop_at: float,
    latencies: list[float],
    period: float | None = None,
    wire: str = "packed",
) -> int:
    """Answers how many sequences it admitted. Closed loop without `period`; with it,
    one Step every `period` seconds (open loop), phase-shifted by the worker's index."""
    async with grpc.aio.insecure_channel(address) as channel:
        # Each worker's Steps on one StepStream, as computed sends them: a request is the
        # Step's wire bytes as field 1 of a StepStreamRequest.
        call = channel.stream_stream(STREAM_METHOD, response_deserializer=pb.StepStreamResponse.FromString)()

        async def step(request: bytes) -> pb.StepResponse:
            await call.write(_field(0x0A, request))
            return (await call.read()).step

        writer = StepWriter(await _register(channel), Prompts(index, wire), wire)
        running: list[tuple[int, list[bytes], pb.AdmitResult]] = []
        admitted = 0
        scheduled = time.perf_counter() + (index / NUM_WORKERS * period if period else 0.0)
        while time.monotonic() < stop_at:
            request, admits = writer.write(running)
            start = time.perf_counter()
            if period is not None:
                if start < scheduled:
                    await asyncio.sleep(scheduled - start)
                    start = time.perf_counter()
                else:
                    start = scheduled  # late because the last Step was: that wait counts
                scheduled += period
            reply = await step(request)
            latencies.append(time.perf_counter() - start)
            running = [
                (sequence_id, blocks, result)
                for (sequence_id, blocks), result in zip(admits, reply.admits)
                if result.admitted
            ]
            admitted += len(running)
        await call.done_writing()
        return admitted


async def naive_worker(address: str, index: int, stop_at: float) -> int:
    """The same work, one Step per block."""
    prompts_of = Prompts(1000 + index)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.BlockDirectoryServiceStub(channel)
        pool = await _register(channel)
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


async def _batched(
    address: str, seconds: float, period: float | None, wire: str = "packed"
) -> tuple[float, list[float]]:
    """Admissions per second and Step latencies of NUM_WORKERS batched workers."""
    latencies: list[float] = []
    start = time.monotonic()
    counts = await asyncio.gather(
        *(batched_worker(address, i, start + seconds, latencies, period, wire) for i in range(NUM_WORKERS))
    )
    return sum(counts) / (time.monotonic() - start), latencies


def _ms(latencies: list[float], percentile: int) -> float:
    return round(statistics.quantiles(latencies, n=100)[percentile - 1] * 1e3, 2)


async def run(address: str, echo_address: str, seconds: float, pure_address: str | None = None) -> dict:
    # The directory core compiled (`address`) against pure (`pure_address`), side by side,
    # interleaved in both orders (the machine is shared; the first of a turn is favoured).
    builds: dict[str, list[float]] = {"compiled": [], "pure": []}
    if pure_address is not None:
        for order in (("compiled", "pure"), ("pure", "compiled")):
            for build in order:
                target = address if build == "compiled" else pure_address
                builds[build].append((await _batched(target, seconds / 2, None))[0])
    # The wire forms side by side, interleaved (the machine is shared): varint, packed, twice.
    rates: dict[str, list[float]] = {wire: [] for wire in WIRES}
    for _ in range(2):
        for wire in WIRES:
            rates[wire].append((await _batched(address, seconds / 2, None, wire))[0])
    closed_rate, closed = await _batched(address, seconds, None)
    ceiling, _ = await _batched(echo_address, seconds, None)
    offered = closed_rate * OPEN_LOOP_LOAD
    period = NUM_WORKERS * ADMITS_PER_STEP / offered  # seconds between one worker's Steps
    open_rate, open_loop = await _batched(address, seconds, period)
    start = time.monotonic()
    naive = await asyncio.gather(*(naive_worker(address, i, start + seconds) for i in range(NUM_WORKERS)))
    naive_s = time.monotonic() - start
    async with grpc.aio.insecure_channel(address) as channel:
        stats = await pb_grpc.DirectoryAdminServiceStub(channel).GetStats(pb.GetStatsRequest())
    return {
        "workers": NUM_WORKERS,
        "admits_per_step": ADMITS_PER_STEP,
        "batched_admissions_per_s": round(closed_rate, 1),
        "varint_wire_admissions_per_s": round(statistics.mean(rates["varint"]), 1),
        "packed_wire_admissions_per_s": round(statistics.mean(rates["packed"]), 1),
        "packed_over_varint": round(statistics.mean(rates["packed"]) / statistics.mean(rates["varint"]), 2),
        "transport_ceiling_admissions_per_s": round(ceiling, 1),
        "batched_over_ceiling": round(closed_rate / ceiling, 2),
        "batched_tokens_per_s": round(closed_rate * PROMPT_TOKENS),
        "step_p50_ms": _ms(closed, 50),
        "step_p99_ms": _ms(closed, 99),
        "open_loop_offered_admissions_per_s": round(offered, 1),
        "open_loop_admissions_per_s": round(open_rate, 1),
        "open_loop_step_p50_ms": _ms(open_loop, 50),
        "open_loop_step_p99_ms": _ms(open_loop, 99),
        "naive_admissions_per_s": round(sum(naive) / naive_s, 2),
        "hit_rate_tokens": round(stats.total.hit_tokens / max(1, stats.total.queried_tokens), 3),
        **(
            {
                "compiled_admissions_per_s": round(statistics.mean(builds["compiled"]), 1),
                "pure_admissions_per_s": round(statistics.mean(builds["pure"]), 1),
                "compiled_over_pure": round(
                    statistics.mean(builds["compiled"]) / statistics.mean(builds["pure"]), 2
                ),
            }
            if builds["pure"]
            else {}
        ),
    }


def main(quick: bool = False) -> dict:
    seconds = 3.0 if quick else 15.0
    StepWriter.check()
    with tempfile.TemporaryDirectory() as workdir:
        proc, address = start_blockd(Path(workdir))
        compiled = is_compiled(Path(workdir))
        # The pure core beside it, where the compiled one runs (blockd.native)
        pure, pure_address = start_blockd(Path(workdir), "pure", native="off") if compiled else (None, None)
        echo, echo_address = start_echo(Path(workdir))
        try:
            figures = asyncio.run(run(address, echo_address, seconds, pure_address))
        finally:
            echo.terminate()
            echo.wait(30)
            if pure is not None:
                pure.terminate()
                pure.wait(30)
            proc.terminate()
            exit_code = proc.wait(30)
    figures["compiled_core"] = compiled
    figures["batched_over_naive"] = round(
        figures["batched_admissions_per_s"] / max(figures["naive_admissions_per_s"], 1e-9), 1
    )
    figures["blockd_exit_code"] = exit_code
    print(
        f"blockd over gRPC, {NUM_WORKERS} workers x {seconds:.0f} s each mode, {PROMPT_TOKENS}-token prompts "
        f"({SHARED_PREFIX} shared), {os.cpu_count()} CPUs:"
    )
    print(
        f"  batched, closed loop: {figures['batched_admissions_per_s']} admissions/s "
        f"({ADMITS_PER_STEP} admits + commits + releases per Step), "
        f"Step p50 {figures['step_p50_ms']} ms, p99 {figures['step_p99_ms']} ms"
    )
    print(
        f"  batched, open loop at {figures['open_loop_offered_admissions_per_s']} admissions/s offered "
        f"({OPEN_LOOP_LOAD:.0%} of the maximum; {figures['open_loop_admissions_per_s']} served): "
        f"Step p50 {figures['open_loop_step_p50_ms']} ms, p99 {figures['open_loop_step_p99_ms']} ms"
    )
    print(
        f"  echo server (gRPC, client and machine only): {figures['transport_ceiling_admissions_per_s']} "
        f"admissions/s; blockd / echo = {figures['batched_over_ceiling']}"
    )
    print(
        f"  wire forms, closed loop, interleaved: packed token_bytes + commit by index "
        f"{figures['packed_wire_admissions_per_s']} admissions/s, varint token_ids + commits with tokens "
        f"{figures['varint_wire_admissions_per_s']} (packed / varint = {figures['packed_over_varint']})"
    )
    if "compiled_over_pure" in figures:
        print(
            f"  directory core, closed loop, interleaved: compiled {figures['compiled_admissions_per_s']} "
            f"admissions/s, pure {figures['pure_admissions_per_s']} "
            f"(compiled / pure = {figures['compiled_over_pure']})"
        )
    else:
        print("  directory core: pure (no current compiled build: make native)")
    print(f"  naive (one Step per block): {figures['naive_admissions_per_s']} admissions/s")
    print(
        f"  batched / naive = {figures['batched_over_naive']}x; prefix hit rate {figures['hit_rate_tokens']}"
    )
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s per mode instead of 15 s")
    parser.add_argument("--echo", action="store_true", help="serve the echo server instead (internal)")
    parser.add_argument("--ready-file", type=Path, help="with --echo: write its address here")
    args = parser.parse_args()
    if args.echo:
        asyncio.run(serve_echo(args.ready_file))
    else:
        main(args.quick)
