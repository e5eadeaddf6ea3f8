"""The OpenAI-compatible gateway: cache-aware routing against round robin, and its own overhead.

1. Routing. blockd, two computed workers with small pools (each holds about
   `POOL_FAMILIES` of the workload's prompt families) and two gateways over the same
   workers, one cache-aware and one `--routing round-robin`. The same shared-prefix
   workload goes through each (families of requests sharing a long system prompt,
   each request its own question, interleaved at random, `CONCURRENCY` in flight),
   blockd flushed in between. The load generator is the official `openai` SDK's async
   client, streaming with include_usage: hit rate (cached ÷ prompt tokens from the
   responses' usage), TTFT p50/p99 as the client sees it (request -> first content
   chunk), requests/s and output tokens/s. With `--aiperf PATH` (or env AIPERF) NVIDIA's
   aiperf is the load generator instead (its own shared-prefix workload:
   --num-prefix-prompts, --prefix-prompt-length; the built-in model's tokenizer from
   computed/default_model, offline); it must live in a virtualenv of its own.
2. Overhead. One request at a time, the same warm prompt, max_tokens 1: gRPC
   `Generate` straight to computed against `POST /v1/completions` through the gateway
   (one worker: no Tokenize/Route; and two workers: local tokenization (--tokenizer) +
   Route + Generate),
   alternating call by call; both clients are plain (grpc's sync stub, http.client
   with keep-alive) so the difference is the gateway's. Goal: <= 1 ms p50.

    .venv/bin/python -m bench.gateway [--quick] [--aiperf PATH]   # or: python -m bench --only gateway
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from openai import AsyncOpenAI

from bench.context import BenchContext
from bench.report import BenchResult, Figure, Goal
from clients.client import BlockdClient
from clients.options import open_channel
from clients.spawn import Daemon, start_blockd, start_computed, start_gateway
from kvcache.v1 import generation_pb2, generation_pb2_grpc

TITLE = "Gateway: cache-aware routing vs round robin, and overhead per request"
MODEL = "default_model"
BLOCK = 16
CONCURRENCY = 4
MAX_TOKENS = 16
POOL_FAMILIES = 5  # what one worker's pool holds, in families
OVERHEAD_GOAL_MS = 1.0
DEFAULT_TOKENIZER = Path(__file__).resolve().parent.parent / "computed" / "default_model"


@dataclass(frozen=True)
class Workload:
    families: int
    per_family: int
    prefix_words: int

    def requests(self, seed: int = 0) -> list[tuple[str, str]]:
        """(system prompt, question) pairs, families interleaved at random (seeded)."""
        rng = random.Random(seed)
        words = ["key", "value", "block", "cache", "prefix", "token", "worker", "route", "hash", "pool"]
        systems = [
            f"Family {f}. " + " ".join(rng.choice(words) for _ in range(self.prefix_words))
            for f in range(self.families)
        ]
        order = [f for f in range(self.families) for _ in range(self.per_family)]
        rng.shuffle(order)
        return [(systems[f], f"Question {i}: what does {rng.choice(words)} do?") for i, f in enumerate(order)]


@dataclass(frozen=True)
class RunStats:
    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    requests_per_s: float
    output_tokens_per_s: float


def run(ctx: BenchContext, aiperf: str | None = None) -> BenchResult:
    aiperf = aiperf or os.environ.get("AIPERF") or None
    workload = Workload(4, 4, 120) if ctx.quick else Workload(8, 8, 240)
    overhead_n = 50 if ctx.quick else 300
    workdir = ctx.scratch("gateway")
    prefix_blocks = workload.prefix_words * 2 // BLOCK + 4  # generous: ~2 tokens a word
    pool = str(POOL_FAMILIES * prefix_blocks + CONCURRENCY * 8)
    env = {"OMP_NUM_THREADS": str(ctx.threads), "MKL_NUM_THREADS": str(ctx.threads)} if ctx.threads else None
    daemons: list[Daemon] = []
    try:
        blockd = start_blockd(workdir, "--log-format", "json", "--lease-ttl", "60")
        daemons.append(blockd)
        args = ("--num-blocks", pool, "--block-size", str(BLOCK), "--log-format", "json")
        with ThreadPoolExecutor(2) as threads:
            futures = [
                threads.submit(start_computed, workdir, blockd.address, *args, env=env, name=f"computed-{i}")
                for i in range(2)
            ]
            workers = [f.result() for f in futures]
        daemons += workers
        addresses = [w.address for w in workers]
        local = ("--tokenizer", f"{MODEL}={DEFAULT_TOKENIZER}")  # routed prompts tokenized in the gateway
        aware = start_gateway(workdir, addresses, *local, blockd=blockd.address, name="gateway-aware")
        robin = start_gateway(
            workdir, addresses, "--routing", "round-robin", blockd=blockd.address, name="gateway-rr"
        )
        single = start_gateway(workdir, addresses[:1], name="gateway-single")
        daemons += [aware, robin, single]
        requests = workload.requests()
        asyncio.run(_drive(aware.address, requests[: CONCURRENCY * 2]))  # warm-up, then a clean cache
        stats = {}
        for name, gateway in (("cache-aware", aware), ("round robin", robin)):
            _flush(blockd.address)
            if aiperf:
                stats[name] = _aiperf(aiperf, gateway.address, workload, workdir / f"aiperf-{gateway.name}")
            else:
                stats[name] = asyncio.run(_drive(gateway.address, requests))
        overhead = {
            "1 worker (Generate only)": _overhead(workers[0].address, single.address, overhead_n),
            "2 workers (local tokenize + Route + Generate)": _overhead(
                workers[0].address, aware.address, overhead_n
            ),
        }
    finally:
        for daemon in reversed(daemons):
            daemon.stop()
    return _result(workload, pool, stats, overhead, "aiperf" if aiperf else "openai SDK (async, streaming)")


async def _drive(address: str, requests: Sequence[tuple[str, str]]) -> RunStats:
    client = AsyncOpenAI(base_url=f"http://{address}/v1", api_key="bench", max_retries=0)
    queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    ttfts: list[float] = []
    prompt = cached = output = 0

    async def one(system: str, question: str) -> None:
        nonlocal prompt, cached, output
        started = time.perf_counter()
        first = None
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            if chunk.usage is not None:
                prompt += chunk.usage.prompt_tokens
                cached += chunk.usage.prompt_tokens_details.cached_tokens
                output += chunk.usage.completion_tokens
        ttfts.append((first or time.perf_counter()) - started)

    async def worker() -> None:
        while not queue.empty():
            await one(*queue.get_nowait())

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    wall = time.perf_counter() - started
    await client.close()
    ttfts.sort()
    return RunStats(
        hit_rate=cached / prompt if prompt else 0.0,
        ttft_p50_ms=statistics.median(ttfts) * 1e3,
        ttft_p99_ms=ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))] * 1e3,
        requests_per_s=len(requests) / wall,
        output_tokens_per_s=output / wall,
    )


def _aiperf(binary: str, address: str, workload: Workload, out: Path) -> RunStats:
    """The same shape of workload from aiperf; its JSON export read back."""
    command = [
        binary, "profile", "--model", MODEL, "--url", f"http://{address}", "--endpoint-type", "chat",
        "--streaming", "--tokenizer", str(DEFAULT_TOKENIZER), "--num-prefix-prompts", str(workload.families),
        "--prefix-prompt-length", str(workload.prefix_words * 2), "--isl", "32", "--osl", str(MAX_TOKENS),
        "--extra-inputs", "ignore_eos:true", "--concurrency", str(CONCURRENCY),
        "--request-count", str(workload.families * workload.per_family), "--random-seed", "1",
        "--output-artifact-dir", str(out), "--no-auto-plot",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
    data = json.loads((out / "profile_export_aiperf.json").read_text())
    ttft = data["time_to_first_token"]
    return RunStats(
        hit_rate=data["overall_usage_prompt_cache_read_pct"]["avg"] / 100,
        ttft_p50_ms=ttft["p50"],
        ttft_p99_ms=ttft["p99"],
        requests_per_s=data["request_throughput"]["avg"],
        output_tokens_per_s=data["output_token_throughput"]["avg"],
    )


def _flush(blockd: str) -> None:
    with BlockdClient(blockd) as client:
        client.flush()


def _overhead(computed: str, gateway: str, n: int) -> tuple[float, float, float]:
    """(direct p50 ms, gateway p50 ms, p50 of the per-pair differences ms), alternating calls."""
    prompt = "import os\nimport sys\n\ndef main(argv):\n    " * 4
    channel = open_channel(computed)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    request = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=1)
    connection = http.client.HTTPConnection(gateway, timeout=60)
    connection.connect()
    connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as grpc's channel does
    # bytes: http.client then sends headers and body in one write (a second small write would
    # wait for the delayed ACK under Nagle, 40 ms, and measure TCP instead of the gateway).
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json", "Authorization": "Bearer bench"}

    def direct() -> float:
        started = time.perf_counter()
        for _ in stub.Generate(request, timeout=60):
            pass
        return time.perf_counter() - started

    def through() -> float:
        started = time.perf_counter()
        connection.request("POST", "/v1/completions", body=body, headers=headers)
        response = connection.getresponse()
        payload = response.read()
        assert response.status == 200, payload
        return time.perf_counter() - started

    try:
        for _ in range(20):  # warm: the prompt cached, connections open
            direct(), through()
        pairs = [(direct(), through()) for _ in range(n)]
    finally:
        connection.close()
        channel.close()
    return (
        statistics.median(d for d, _ in pairs) * 1e3,
        statistics.median(g for _, g in pairs) * 1e3,
        statistics.median(g - d for d, g in pairs) * 1e3,
    )


def _result(
    workload: Workload,
    pool: str,
    stats: dict[str, RunStats],
    overhead: dict[str, tuple[float, float, float]],
    loadgen: str,
) -> BenchResult:
    aware, robin = stats["cache-aware"], stats["round robin"]
    single = overhead["1 worker (Generate only)"][2]
    routed = overhead["2 workers (local tokenize + Route + Generate)"][2]
    figures = [
        Figure("hit rate, cache-aware", round(aware.hit_rate, 3)),
        Figure("hit rate, round robin", round(robin.hit_rate, 3)),
        Figure("TTFT p50 cache-aware ÷ round robin", round(aware.ttft_p50_ms / robin.ttft_p50_ms, 3)),
        Figure("throughput cache-aware ÷ round robin", round(aware.requests_per_s / robin.requests_per_s, 3)),
        Figure("gateway overhead p50, 1 worker", round(single, 3), "ms", Goal("<=", OVERHEAD_GOAL_MS)),
        Figure("gateway overhead p50, 2 workers routed", round(routed, 3), "ms"),
    ]
    table = [
        "| routing | hit rate | TTFT p50 (ms) | TTFT p99 (ms) | requests/s | output tok/s |",
        "|---|---|---|---|---|---|",
    ]
    table += [
        f"| {name} | {s.hit_rate:.3f} | {s.ttft_p50_ms:.1f} | {s.ttft_p99_ms:.1f} | "
        f"{s.requests_per_s:.2f} | {s.output_tokens_per_s:.1f} |"
        for name, s in stats.items()
    ]
    table += ["", "| path | direct gRPC p50 (ms) | through the gateway p50 (ms) | overhead p50 (ms) |"]
    table += ["|---|---|---|---|"]
    table += [f"| {name} | {d:.3f} | {g:.3f} | {o:.3f} |" for name, (d, g, o) in overhead.items()]
    details = (
        f"{workload.families} families × {workload.per_family} chat requests (a {workload.prefix_words}-word "
        f"system prompt per family, one question each), {MAX_TOKENS} tokens out (ignore_eos), "
        f"{CONCURRENCY} in flight, {loadgen} as the load generator; two workers of "
        f"{pool} blocks × {BLOCK} tokens each (about {POOL_FAMILIES} families).\n\n" + "\n".join(table)
    )
    return BenchResult("gateway", TITLE, figures, details)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument(
        "--aiperf", help="aiperf executable as load generator (default: env AIPERF; none: openai SDK)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        ctx = BenchContext(args.quick, Path(tmp), Path(tmp), "python -m bench.gateway")
        result = run(ctx, args.aiperf)
    for figure in result.figures:
        goal = f"  (goal {figure.goal.op} {figure.goal.target})" if figure.goal else ""
        print(f"{figure.name}: {figure.value} {figure.unit}{goal}")
    print()
    print(result.details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
