"""The OpenAI-compatible gateway: cache-aware routing against round robin, and its own overhead.

1. Routing. blockd, two computed workers with small pools (each holds about
   `POOL_FAMILIES` of the workload's prompt families) and four gateways over the same
   workers: cache-aware (cached prefix weighed against each worker's queue, the cached
   prefixes from the gateway's directory mirror), the same with `--no-mirror` (from
   blockd's Route per request), `--routing prefix` (cache affinity alone) and `--routing
   round-robin`. The same shared-prefix
   workload goes through each (families of requests sharing a long system prompt,
   each request its own question, interleaved at random, `CONCURRENCY` in flight),
   blockd flushed before each run; `ROUNDS` rounds, the order of the policies rotated
   each round, percentiles over every round's requests. The load generator is the official `openai` SDK's async
   client, streaming with include_usage: hit rate (cached ÷ prompt tokens from the
   responses' usage), TTFT p50/p99 as the client sees it (request -> first content
   chunk), requests/s and output tokens/s. With `--aiperf PATH` (or env AIPERF) NVIDIA's
   aiperf is the load generator instead (its own shared-prefix workload:
   --num-prefix-prompts, --prefix-prompt-length; the built-in model's tokenizer from
   computed/default_model, offline); it must live in a virtualenv of its own.
2. Overhead. One request at a time, the same warm prompt, max_tokens 1: gRPC
   `Generate` straight to computed against `POST /v1/completions` through the gateway
   (one worker: no Tokenize/Route; two workers routed: local tokenization (--tokenizer)
   + the directory mirror's answer + Generate; and the same with --no-mirror: blockd's
   Route RPC instead of the mirror), alternating call by call (which of the two goes
   first alternates too), the direct call to the worker the gateway picks; both clients
   are plain (grpc's sync stub, http.client with keep-alive) so the difference is the
   gateway's: p50 and p99 of the per-pair differences, pooled over `OVERHEAD_REPS`
   repetitions (the paths take turns, so a busy spell of the machine falls on each).
   Goal: <= 1 ms p50, one worker and two routed.

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
from gateway.mirror import DirectoryMirror, PoolDescription
from gateway.prefix_hash import PromptChain, namespace_seed, token_bytes
from kvcache.v1 import generation_pb2, generation_pb2_grpc

TITLE = "Gateway: cache-aware routing vs round robin, and overhead per request"
MODEL = "default_model"
BLOCK = 16
CONCURRENCY = 4
MAX_TOKENS = 16
POOL_FAMILIES = 5  # what one worker's pool holds, in families
ROUNDS = 3  # runs of each routing policy (p99 of one 64-request run is its slowest request)
OVERHEAD_REPS = 3  # repetitions of each overhead path, pooled
OVERHEAD_GOAL_MS = 1.0
DEFAULT_TOKENIZER = Path(__file__).resolve().parent.parent / "computed" / "default_model"


@dataclass(frozen=True)
class Workload:
    families: int
    per_family: int  # requests per family on average
    prefix_words: int
    # 0: every family alike; s > 0: family f gets a share of the requests ∝ 1/(f+1)^s (hot
    # families, the case where cache affinity piles requests onto one worker).
    skew: float = 0.0

    def requests(self, seed: int = 0) -> list[tuple[str, str]]:
        """(system prompt, question) pairs, families interleaved at random (seeded)."""
        rng = random.Random(seed)
        words = ["key", "value", "block", "cache", "prefix", "token", "worker", "route", "hash", "pool"]
        systems = [
            f"Family {f}. " + " ".join(rng.choice(words) for _ in range(self.prefix_words))
            for f in range(self.families)
        ]
        total = self.families * self.per_family
        weights = [1 / (f + 1) ** self.skew for f in range(self.families)]
        counts = [round(total * w / sum(weights)) for w in weights]
        order = [f for f in range(self.families) for _ in range(counts[f])]
        rng.shuffle(order)
        return [(systems[f], f"Question {i}: what does {rng.choice(words)} do?") for i, f in enumerate(order)]


@dataclass(frozen=True)
class RunStats:
    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    requests_per_s: float
    output_tokens_per_s: float
    ttfts_ms: tuple[float, ...] = ()  # every request's (empty from aiperf)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    spread: str = ""  # the runs' own figures, when pooled

    @classmethod
    def pooled(cls, runs: Sequence[RunStats]) -> RunStats:
        """Several runs as one: hit rate over all their tokens, percentiles over all their
        requests (medians of the runs' own figures where the requests are not known)."""
        ttfts = sorted(t for r in runs for t in r.ttfts_ms)
        prompt = sum(r.prompt_tokens for r in runs)
        return cls(
            hit_rate=sum(r.cached_tokens for r in runs) / prompt
            if prompt
            else statistics.median(r.hit_rate for r in runs),
            ttft_p50_ms=statistics.median(ttfts) if ttfts else statistics.median(r.ttft_p50_ms for r in runs),
            ttft_p99_ms=_percentile(ttfts, 0.99) if ttfts else statistics.median(r.ttft_p99_ms for r in runs),
            requests_per_s=statistics.median(r.requests_per_s for r in runs),
            output_tokens_per_s=statistics.median(r.output_tokens_per_s for r in runs),
            ttfts_ms=tuple(ttfts),
            prompt_tokens=prompt,
            cached_tokens=sum(r.cached_tokens for r in runs),
            spread="; ".join(f"{r.hit_rate:.2f}, {r.ttft_p50_ms:.0f}/{r.ttft_p99_ms:.0f}" for r in runs),
        )


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


def run(ctx: BenchContext, aiperf: str | None = None, skew: float = 0.0, rounds: int = ROUNDS) -> BenchResult:
    aiperf = aiperf or os.environ.get("AIPERF") or None
    workload = Workload(4, 4, 120, skew) if ctx.quick else Workload(8, 8, 240, skew)
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
        gateways = {
            name: start_gateway(workdir, addresses, *args, blockd=blockd.address, name=f"gateway-{routing}")
            for name, routing, args in (
                ("cache-aware", "cache-aware", local),
                ("cache-aware, Route per request", "cache-aware-route", ("--no-mirror", *local)),
                ("prefix only", "prefix", ("--routing", "prefix", *local)),
                ("round robin", "round-robin", ("--routing", "round-robin")),
            )
        }
        daemons += gateways.values()
        single = start_gateway(workdir, addresses[:1], name="gateway-single")
        daemons.append(single)
        requests = workload.requests()
        for gateway in gateways.values():  # warm-up, then a clean cache
            asyncio.run(_drive(gateway.address, requests[: CONCURRENCY * 2]))
        runs: dict[str, list[RunStats]] = {name: [] for name in gateways}
        rounds = 1 if ctx.quick or aiperf else rounds
        for r in range(rounds):
            names = list(gateways)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                _flush(blockd.address)
                gateway = gateways[name]
                if aiperf:
                    out = workdir / f"aiperf-{gateway.name}-{r}"
                    runs[name].append(_aiperf(aiperf, gateway.address, workload, out))
                else:
                    runs[name].append(asyncio.run(_drive(gateway.address, requests)))
        stats = {name: RunStats.pooled(r) for name, r in runs.items()}
        _flush(blockd.address)
        # flushed and the direct call warms first: routing sends the gateway's to the same worker
        paths = {
            SINGLE: single.address,
            ROUTED: gateways["cache-aware"].address,
            ROUTED_BY_ROUTE: gateways["cache-aware, Route per request"].address,
        }
        pairs: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
        reps = 1 if ctx.quick else OVERHEAD_REPS
        for _ in range(reps):
            for name, address in paths.items():
                pairs[name] += _overhead_pairs(workers[0].address, address, overhead_n)
        overhead = {name: _summary(p) for name, p in pairs.items()}
        lookups = {n: mirror_answer_us(n) for n in (48, 512, 4096)}
        answers = {
            name: _route_answers(gateways[name].address)
            for name in ("cache-aware", "cache-aware, Route per request")
        }
    finally:
        for daemon in reversed(daemons):
            daemon.stop()
    return _result(
        workload,
        rounds,
        pool,
        stats,
        overhead,
        "aiperf" if aiperf else "openai SDK (async, streaming)",
        answers,
        lookups,
        reps,
    )


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
    ttfts_ms = sorted(t * 1e3 for t in ttfts)
    return RunStats(
        hit_rate=cached / prompt if prompt else 0.0,
        ttft_p50_ms=statistics.median(ttfts_ms),
        ttft_p99_ms=_percentile(ttfts_ms, 0.99),
        requests_per_s=len(requests) / wall,
        output_tokens_per_s=output / wall,
        ttfts_ms=tuple(ttfts_ms),
        prompt_tokens=prompt,
        cached_tokens=cached,
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


def _route_answers(gateway: str) -> dict[str, int]:
    """Where a gateway's routed requests learnt the cached prefixes: {"mirror": n, "route": n}."""
    connection = http.client.HTTPConnection(gateway, timeout=10)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    out = {"mirror": 0, "route": 0}
    for line in text.splitlines():
        if line.startswith("gateway_route_answers_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = int(float(line.split()[-1]))
    return out


def _flush(blockd: str) -> None:
    with BlockdClient(blockd) as client:
        client.flush()


OVERHEAD_PROMPT = "import os\nimport sys\n\ndef main(argv):\n    " * 4


def mirror_answer_us(num_tokens: int, repeats: int = 2000) -> tuple[float, float]:
    """(p50, p99) µs of the directory mirror's answer for two pools, one caching all of a
    `num_tokens` prompt and the other half of it (every block of it hashed and looked up:
    the mirror's worst case for that length). In process: the pure core alone."""
    rng = random.Random(num_tokens)
    tokens = tuple(rng.randrange(30_000) for _ in range(num_tokens))
    seed = namespace_seed(MODEL, "", "float32", "", BLOCK)
    chain = PromptChain(seed, token_bytes(tokens), BLOCK)
    hashes = [chain.hash(i) for i in range(chain.num_blocks)]
    pools = [PoolDescription("p1", "w:1", seed, BLOCK), PoolDescription("p2", "w:2", seed, BLOCK)]
    mirror = DirectoryMirror(max_blocks=1_000_000)
    mirror.load(0, pools, [("p1", h) for h in hashes] + [("p2", h) for h in hashes[: len(hashes) // 2]])
    assert mirror.cached_tokens(["w:1", "w:2"], tokens) == [len(hashes) * BLOCK, len(hashes) // 2 * BLOCK]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        mirror.cached_tokens(["w:1", "w:2"], tokens)
        times.append(time.perf_counter() - started)
    times.sort()
    return statistics.median(times) * 1e6, _percentile(times, 0.99) * 1e6


SINGLE = "1 worker (Generate only)"
ROUTED = "2 workers routed (local tokenize + mirror + Generate)"
ROUTED_BY_ROUTE = "2 workers routed, --no-mirror (local tokenize + Route RPC + Generate)"


def _overhead_pairs(computed: str, gateway: str, n: int) -> list[tuple[float, float]]:
    """n (direct s, through the gateway s) pairs, alternating calls and which of the two goes first."""
    prompt = OVERHEAD_PROMPT
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
        pairs = []
        for i in range(n):
            if i % 2:
                g = through()
                pairs.append((direct(), g))
            else:
                pairs.append((direct(), through()))
    finally:
        connection.close()
        channel.close()
    return pairs


def _summary(pairs: Sequence[tuple[float, float]]) -> tuple[float, float, float, float]:
    """(direct p50 ms, gateway p50 ms, p50 and p99 of the per-pair differences ms)."""
    differences = sorted((g - d) * 1e3 for d, g in pairs)
    return (
        statistics.median(d for d, _ in pairs) * 1e3,
        statistics.median(g for _, g in pairs) * 1e3,
        statistics.median(differences),
        _percentile(differences, 0.99),
    )


def _result(
    workload: Workload,
    rounds: int,
    pool: str,
    stats: dict[str, RunStats],
    overhead: dict[str, tuple[float, float, float, float]],
    loadgen: str,
    answers: dict[str, dict[str, int]],
    lookups: dict[int, tuple[float, float]],
    rounds_overhead: int = OVERHEAD_REPS,
) -> BenchResult:
    aware, robin = stats["cache-aware"], stats["round robin"]
    single, routed, by_route = overhead[SINGLE], overhead[ROUTED], overhead[ROUTED_BY_ROUTE]
    figures = [
        Figure("hit rate, cache-aware", round(aware.hit_rate, 3)),
        Figure(
            "hit rate, cache-aware with Route per request",
            round(stats["cache-aware, Route per request"].hit_rate, 3),
        ),
        Figure("hit rate, round robin", round(robin.hit_rate, 3)),
        Figure("TTFT p50 cache-aware ÷ round robin", round(aware.ttft_p50_ms / robin.ttft_p50_ms, 3)),
        Figure("TTFT p99 cache-aware ÷ round robin", round(aware.ttft_p99_ms / robin.ttft_p99_ms, 3)),
        Figure("throughput cache-aware ÷ round robin", round(aware.requests_per_s / robin.requests_per_s, 3)),
        Figure("gateway overhead p50, 1 worker", round(single[2], 3), "ms", Goal("<=", OVERHEAD_GOAL_MS)),
        Figure("gateway overhead p99, 1 worker", round(single[3], 3), "ms"),
        Figure(
            "gateway overhead p50, 2 workers routed", round(routed[2], 3), "ms", Goal("<=", OVERHEAD_GOAL_MS)
        ),
        Figure("gateway overhead p99, 2 workers routed", round(routed[3], 3), "ms"),
        Figure("gateway overhead p50, 2 workers routed, Route per request", round(by_route[2], 3), "ms"),
        Figure("gateway overhead p99, 2 workers routed, Route per request", round(by_route[3], 3), "ms"),
        Figure("directory mirror answer p50, 4,096-token prompt", round(lookups[4096][0], 1), "µs"),
    ]
    table = [
        "| routing | hit rate | TTFT p50 (ms) | TTFT p99 (ms) | requests/s | output tok/s | per round: hit rate, p50/p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    table += [
        f"| {name} | {s.hit_rate:.3f} | {s.ttft_p50_ms:.1f} | {s.ttft_p99_ms:.1f} | "
        f"{s.requests_per_s:.2f} | {s.output_tokens_per_s:.1f} | {s.spread} |"
        for name, s in stats.items()
    ]
    table += [
        "",
        "| path | direct gRPC p50 (ms) | through the gateway p50 (ms) | overhead p50 (ms) | overhead p99 (ms) |",
    ]
    table += ["|---|---|---|---|---|"]
    table += [
        f"| {name} | {d:.3f} | {g:.3f} | {o:.3f} | {o99:.3f} |" for name, (d, g, o, o99) in overhead.items()
    ]
    details = (
        f"{workload.families} families × {workload.per_family} chat requests (a {workload.prefix_words}-word "
        f"system prompt per family, popularity skew {workload.skew}: ∝ 1/(f+1)^skew; "
        f"one question each), {MAX_TOKENS} tokens out (ignore_eos), "
        f"{CONCURRENCY} in flight, {loadgen} as the load generator, {rounds} round(s) per policy; two workers of "
        f"{pool} blocks × {BLOCK} tokens each (about {POOL_FAMILIES} families). Where the cache-aware "
        f"gateways learnt the cached prefixes (requests, every run and the overhead pairs): "
        + "; ".join(f"{name}: mirror {a['mirror']}, Route {a['route']}" for name, a in answers.items())
        + f". Overhead: {rounds_overhead} × the pairs of each path, pooled.\n\n"
        + "\n".join(table)
    )
    details += (
        "\n\nThe directory mirror's answer in process (two pools, one caching the whole prompt, "
        "the other half of it; token ids in, cached tokens per worker out):\n\n"
        "| prompt tokens | mirror answer p50 (µs) | p99 (µs) |\n|---|---|---|\n"
        + "\n".join(f"| {n} | {p50:.1f} | {p99:.1f} |" for n, (p50, p99) in lookups.items())
    )
    return BenchResult("gateway", TITLE, figures, details)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument(
        "--aiperf", help="aiperf executable as load generator (default: env AIPERF; none: openai SDK)"
    )
    parser.add_argument(
        "--skew", type=float, default=0.0, help="family popularity ∝ 1/(f+1)^SKEW (0: uniform)"
    )
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="runs of each routing policy")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        ctx = BenchContext(args.quick, Path(tmp), Path(tmp), "python -m bench.gateway")
        result = run(ctx, args.aiperf, args.skew, args.rounds)
    for figure in result.figures:
        goal = f"  (goal {figure.goal.op} {figure.goal.target})" if figure.goal else ""
        print(f"{figure.name}: {figure.value} {figure.unit}{goal}")
    print()
    print(result.details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
