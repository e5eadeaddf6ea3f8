"""9. Host overhead: what the engine does per forward besides the forward, on any machine.

A micro model (Qwen3 shape, 1 layer, hidden 64, vocabulary 10,240) makes the forward
cheap, so the rest shows: the scheduler, the batch's plan and tensors, sampling's read
back, the stream messages, the directory's Steps. nano-vllm's lengths (prompts uniform
in 100-1,024 tokens), shorter outputs (uniform in 16-128), all 256 requests as concurrent
gRPC streams through both daemons. From computed's counters, as deltas over the run:

- host ms per forward = (client wall - seconds inside forwards) / forwards: on a GPU the
  device idles through it unless it overlaps the forward;
- directory wait share = seconds the engine waited on blockd / client wall.

Goals (issue 42): <= 1 ms per forward, directory wait <= 2% of wall.
"""

from __future__ import annotations

import random
import sys

from bench.context import BenchContext
from bench.gpu import _run_ours, build_checkpoint
from bench.report import BenchResult, Figure, Goal, median
from bench.stack import Stack

TITLE = "9. Host overhead"

MICRO = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 10_240,
    "max_position_embeddings": 4096,
}
NUM_REQUESTS = 256
HOST_GOAL_MS = 1.0
WAIT_GOAL = 0.02


def workload(num_seqs: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's prompt lengths and ids (100-1,024, ids < 10,000), outputs 16-128."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 9_999) for _ in range(rng.randint(100, 1024))] for _ in range(num_seqs)]
    outputs = [rng.randint(16, 128) for _ in range(num_seqs)]
    return prompts, outputs


def run(ctx: BenchContext) -> BenchResult:
    num_seqs = 64 if ctx.quick else NUM_REQUESTS
    repeats = 1 if ctx.quick else 3
    model_dir = build_checkpoint(ctx.scratch("host_overhead") / "micro", MICRO, "float32")
    args = (
        "--max-num-seqs",
        str(num_seqs),
        "--max-num-batched-tokens",
        "16384",
        "--max-model-len",
        "2048",
        "--num-blocks",
        str(num_seqs * 80 + 256),
    )
    samples = []
    with Stack(ctx.scratch("host_overhead"), *args, model=model_dir, threads=ctx.threads) as stack:
        warm_prompts, warm_outputs = workload(8, seed=99)
        _run_ours(stack.computed_address, warm_prompts, warm_outputs)
        for rep in range(repeats):
            prompts, outputs = workload(num_seqs, seed=rep)
            before = stack.metrics()
            wall = _run_ours(stack.computed_address, prompts, outputs)
            after = stack.metrics()
            delta = {k: after[k] - before[k] for k in after if k.endswith("_total")}
            forwards = delta["computed_forwards_total"]
            sample = {
                "host_ms": 1000 * (wall - delta["computed_forward_seconds_total"]) / forwards,
                "wait": delta["computed_directory_wait_seconds_total"] / wall,
                "forward_ms": 1000 * delta["computed_forward_seconds_total"] / forwards,
                "forwards": forwards,
                "steps": delta["computed_steps_total"],
                "wall": wall,
                "tokens": sum(outputs),
            }
            print(f"host_overhead: {sample}", file=sys.stderr, flush=True)
            samples.append(sample)
    host_ms = median(s["host_ms"] for s in samples)
    wait = median(s["wait"] for s in samples)
    figures = [
        Figure("host ms per forward, outside it", round(host_ms, 2), "ms", Goal("<=", HOST_GOAL_MS)),
        Figure("directory wait ÷ wall", round(wait, 4), "", Goal("<=", WAIT_GOAL)),
        Figure("forward ms (inside)", round(median(s["forward_ms"] for s in samples), 2), "ms"),
        Figure("output tok/s", round(median(s["tokens"] / s["wall"] for s in samples), 1), "tok/s"),
    ]
    details = (
        f"{num_seqs} concurrent streams, prompts 100-1,024 tokens, outputs 16-128, a 1-layer hidden-64 "
        f"Qwen3-shaped model on CPU float32; medians of {repeats} runs "
        f"(forwards per run {', '.join(str(int(s['forwards'])) for s in samples)}, "
        f"Steps {', '.join(str(int(s['steps'])) for s in samples)}). Host ms = (wall - forward "
        "seconds) / forwards; the forward's seconds include its own host work (plan, tensors, "
        "sampling). computed `" + " ".join(args) + "`."
    )
    return BenchResult("host_overhead", TITLE, figures, details)
