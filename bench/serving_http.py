"""Serving through HTTP with a standard client: `vllm bench serve` against our stack
(blockd + one computed + the gateway) and against vLLM's own OpenAI server, same model,
same machine, one run, the sides alternating per workload.

Workloads (128 requests, 32 in flight, streamed, 64 tokens out, --ignore-eos):
shared: 4 prefixes of 1,024 tokens, a 16-token suffix each (vLLM's prefix_repetition);
unrelated: 1,040 random tokens each (vLLM's random). vLLM runs with block size 32 (its
CPU backend's least), every core bound as its CPU guide says. Both sides run in float32
and in bfloat16 (the checkpoint's dtype, vLLM's default), as the peer benchmark does: the
headline ratio is each side's fastest run per workload, whatever its dtype (a baseline
must be the best its library does), and the same-precision ratios stand beside it.
Neither side is told a temperature: each serves its own default (ours greedy, vLLM the
checkpoint's generation config).

    .venv/bin/python -m bench.serving_http [--num-prompts 128] [--out DIR]

Needs the peer virtualenv (`make bench-peer` builds .venv-vllm).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from bench.stack import read_metrics_port, scrape_metrics
from clients.spawn import start_blockd, start_computed, start_gateway

if TYPE_CHECKING:
    from bench.context import BenchContext
    from bench.report import BenchResult

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-vllm"
MODEL_DIR = REPO / "computed" / "default_model"
MODEL = "default_model"
TITLE = "10. HTTP serving against vLLM's OpenAI server"
WORKLOADS = {
    "shared": [
        "--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", "4",
        "--prefix-repetition-prefix-len", "1024", "--prefix-repetition-suffix-len", "16",
        "--prefix-repetition-output-len", "64",
    ],
    "unrelated": ["--dataset-name", "random", "--random-input-len", "1040", "--random-output-len", "64"],
}  # fmt: skip
DTYPES = ("float32", "bfloat16")
# Runs a side per workload and dtype, in turns; each side keeps its best. 4, not 2: with
# 2, the same code's shared-prefix ratio was 1.32x one run and 1.16x the next (ours
# 4,664 then 4,140 tok/s; 5 paired rounds in one window gave ours 5,111-6,781, vLLM
# 3,186-5,206, so one side's best of 2 may miss its good rounds entirely).
ROUNDS = 4
# computed keeps torch's default threads (one per core). Tried: every core but one, left to
# the gateway, blockd and the client: the shared workload (streaming-bound) did better on
# the 2-core machine while others ran (6 interleaved pairs, bfloat16: median 2,150 output
# tok/s against 1,220), but the unrelated one (1,040-token prefills, compute-bound) lost:
# one full run of this benchmark, as busy, gave 0.82x vLLM there (1.31x with every core
# on a quiet machine, the run before).
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="runs a side per workload, in turns")
    parser.add_argument(
        "--out", type=Path, default=None, help="where the result JSONs go (default: a temp dir)"
    )
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="serving-http-"))
    rows = measure(out, args)
    print(table(rows + best_rows(rows)))
    print(phases_table(rows))
    print(f"results: {out}")


def run(ctx: BenchContext) -> BenchResult:
    """`python -m bench --only serving`: the same run, as a section of BENCHMARKS.md."""
    from bench.report import BenchResult, Figure, Goal

    num_prompts = 32 if ctx.quick else 128
    args = argparse.Namespace(num_prompts=num_prompts, concurrency=32, rounds=1 if ctx.quick else ROUNDS)
    rows = measure(ctx.scratch("serving"), args)
    figures = []
    for name, ours, theirs in best_rows(rows):
        throughput = ours["output_throughput"] / theirs["output_throughput"]
        figures.append(
            Figure(f"ours ÷ vLLM output tok/s, {name}", round(throughput, 2), "x", Goal(">=", 1.5))
        )
        ttft = ours["median_ttft_ms"] / theirs["median_ttft_ms"]
        goal = Goal("<=", 0.5) if name.startswith("shared") else None
        figures.append(Figure(f"ours ÷ vLLM TTFT p50, {name}", round(ttft, 2), "x", goal))
    for name, ours, theirs in rows:
        throughput = ours["output_throughput"] / theirs["output_throughput"]
        figures.append(Figure(f"ours ÷ vLLM output tok/s, {name}", round(throughput, 2), "x", None))
    details = (
        f"`vllm bench serve` (vLLM 0.32's CLI from .venv-vllm), {num_prompts} requests, 32 in flight, streamed, "
        f"{args.rounds} rounds a side in turns (seeds 0..{args.rounds - 1}), each side's best run kept, "
        "64 tokens out, `--ignore-eos`, against our stack (blockd + one computed + the gateway) and vLLM's "
        "OpenAI server (block size 32), same model, same machine; per dtype (float32, then bfloat16) each "
        "workload runs on vLLM's server and then on ours. The headline rows compare each side's fastest "
        "run per workload, whatever its dtype; the rows below them compare the same dtype. Neither side is "
        "told a temperature: ours serves greedy, vLLM its checkpoint's generation config.\n\n"
        + table(rows)
        + "\n\nWhere our time to first token went in each run kept above: the client's mean beside the "
        "gateway's (its /metrics: received -> the worker's first message in) and our worker's, in its parts "
        "(computed's /metrics: admission = received, parsed, tokenized, checked; queue = until its first "
        "forward starts; prefill = to its first token; queue + prefill = the worker's TTFT). Client - "
        "gateway is the client and HTTP both ways; gateway - worker admission - worker TTFT is the "
        "gateway's parsing and placement and gRPC both ways.\n\n" + phases_table(rows)
    )
    return BenchResult("serving", TITLE, figures, details)


def best_rows(rows: list[tuple[str, dict, dict]]) -> list[tuple[str, dict, dict]]:
    """Per workload, each side's run of highest output throughput, whatever its dtype."""
    best: dict[str, list] = {}
    for label, ours, theirs in rows:
        name = label.split(",")[0]
        entry = best.setdefault(name, [ours, theirs])
        if ours["output_throughput"] > entry[0]["output_throughput"]:
            entry[0] = ours
        if theirs["output_throughput"] > entry[1]["output_throughput"]:
            entry[1] = theirs
    return [(f"{name} (each side's best dtype)", ours, theirs) for name, (ours, theirs) in best.items()]


def measure(out: Path, args: argparse.Namespace) -> list[tuple[str, dict, dict]]:
    """Each workload in each dtype through vLLM's server, then through ours:
    ("workload, dtype", ours, theirs)."""
    out.mkdir(parents=True, exist_ok=True)
    blockd = start_blockd(out)
    rows = []
    try:
        for dtype in DTYPES:
            computed = start_computed(
                out,
                blockd.address,
                "--dtype",
                dtype,
                "--metrics-port",
                "0",
                "--log-format",
                "json",
                model=MODEL_DIR,
                name=f"computed-{dtype}",
            )
            metrics_port = read_metrics_port(computed)
            gateway = start_gateway(out, [computed.address], blockd=blockd.address, name=f"gateway-{dtype}")
            gateway_port = int(gateway.address.rpartition(":")[2])  # its /metrics is on its HTTP port
            vllm, vllm_url = _start_vllm(out, dtype)
            try:
                for name, flags in WORKLOADS.items():
                    # Rounds in turns, each side keeping its best (a baseline must be the best
                    # its library does): one run a side moved either side's figure by 20-40%
                    # between runs of the same code on this 2-core machine. Each round has its
                    # own seed, so no round finds another's prompts cached.
                    best: dict[str, dict] = {}
                    for seed in range(args.rounds):
                        tag = f"{name}_{dtype}_{seed}"
                        for side, url in (("vllm", vllm_url), ("ours", f"http://{gateway.address}")):
                            ports = (metrics_port, gateway_port)
                            before = [scrape_metrics(p) for p in ports] if side == "ours" else None
                            result = _bench(url, name, flags, out / f"{side}_{tag}.json", args, seed)
                            if before is not None:
                                after = [scrape_metrics(p) for p in ports]
                                result[PHASES_KEY] = {
                                    **worker_phases(before[1], after[1], GATEWAY_PHASES),
                                    **worker_phases(before[0], after[0]),
                                }
                            if (
                                side not in best
                                or result["output_throughput"] > best[side]["output_throughput"]
                            ):
                                best[side] = result
                    rows.append((f"{name}, {dtype}", best["ours"], best["vllm"]))
            finally:
                vllm.terminate()
                vllm.wait(60)
                gateway.stop()
                computed.stop()
    finally:
        blockd.stop()
    return rows


# Our time to first token in its parts: name in a result -> metric. The gateway's view
# (its /metrics): received -> the worker's first message in (parsing, placement, gRPC both
# ways and all of the worker's part); the worker's (computed's /metrics, EngineObserver).
PHASES_KEY = "worker_phases_ms"
GATEWAY_PHASES = {"gateway: received -> first chunk": "gateway_time_to_first_chunk_seconds"}
PHASES = {
    "admission": "computed_request_admission_seconds",
    "queue": "computed_request_queue_seconds",
    "prefill": "computed_request_prefill_seconds",
    "worker TTFT": "computed_time_to_first_token_seconds",
}


def worker_phases(
    before: dict[str, float], after: dict[str, float], phases: dict[str, str] = PHASES
) -> dict[str, float]:
    """Each phase's mean ms per request between two scrapes of a daemon's /metrics
    (computed's for `PHASES`, the gateway's for `GATEWAY_PHASES`)."""
    out = {}
    for name, metric in phases.items():
        count = after[metric + "_count"] - before.get(metric + "_count", 0.0)
        total = after[metric + "_sum"] - before.get(metric + "_sum", 0.0)
        out[name] = 1000 * total / count if count else float("nan")
    return out


def phases_table(rows: list[tuple[str, dict, dict]]) -> str:
    """Where our time to first token went in each kept run: the client's mean beside the
    gateway's view and the worker's phases (client - gateway: the client and HTTP both
    ways; gateway - worker admission - worker TTFT: the gateway's parsing and placement and
    gRPC both ways). A phase a run has no figure for shows nan."""
    columns = [*GATEWAY_PHASES, *PHASES]
    lines = [
        "| workload | client TTFT mean ms | " + " | ".join(GATEWAY_PHASES) + " | worker: " + " | ".join(PHASES)
        + " (mean ms) |",
        "|---|---|" + "---|" * len(columns),
    ]  # fmt: skip
    for name, ours, _ in rows:
        phases = ours.get(PHASES_KEY)
        if phases is not None:
            cells = " | ".join(f"{phases.get(p, float('nan')):.1f}" for p in columns)
            lines.append(f"| {name} | {ours['mean_ttft_ms']:.1f} | {cells} |")
    return "\n".join(lines)


def table(rows: list[tuple[str, dict, dict]]) -> str:
    lines = [
        "| workload | output tok/s ours / vLLM (ratio) | TTFT p50 ms ours / vLLM (ratio) | TPOT p50 ms ours / vLLM |",
        "|---|---|---|---|",
    ]
    for name, ours, theirs in rows:
        tput = ours["output_throughput"] / theirs["output_throughput"]
        ttft = ours["median_ttft_ms"] / theirs["median_ttft_ms"]
        lines.append(
            f"| {name} | {ours['output_throughput']:.0f} / {theirs['output_throughput']:.0f} ({tput:.2f}x) "
            f"| {ours['median_ttft_ms']:.0f} / {theirs['median_ttft_ms']:.0f} ({ttft:.2f}x) "
            f"| {ours['median_tpot_ms']:.1f} / {theirs['median_tpot_ms']:.1f} |"
        )
    return "\n".join(lines)


def _bench(
    base_url: str, name: str, flags: list[str], result: Path, args: argparse.Namespace, seed: int = 0
) -> dict:
    command = [
        str(VENV / "bin" / "python"), str(REPO / "bench" / "peer" / "vllm_cli.py"), "bench", "serve",
        "--backend", "openai", "--base-url", base_url, "--model", MODEL, "--tokenizer", str(MODEL_DIR),
        *flags, "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--ignore-eos", "--seed", str(seed), "--save-result", "--result-filename", str(result),
    ]  # fmt: skip
    with open(result.with_suffix(".log"), "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=1800, cwd=REPO)
    return json.loads(result.read_text())


def _start_vllm(out: Path, dtype: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE="4",
    )
    preload = [str(p) for p in (TCMALLOC, VENV / "lib" / "libiomp5.so") if p.is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    command = [
        str(VENV / "bin" / "python"), str(REPO / "bench" / "peer" / "vllm_cli.py"), "serve", str(MODEL_DIR),
        "--served-model-name", MODEL, "--dtype", dtype, "--block-size", "32", "--max-model-len", "8192",
        "--max-num-seqs", "64", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    log = open(out / f"vllm_serve_{dtype}.log", "w")  # noqa: SIM115 (the server's lifetime)
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"vLLM's server exited; see {out / f'vllm_serve_{dtype}.log'}")
        try:
            urllib.request.urlopen(f"{url}/v1/models", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(2)
    proc.kill()
    sys.exit("vLLM's server did not start within 900 s")


if __name__ == "__main__":
    main()
