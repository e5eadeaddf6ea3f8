"""1. Redundant prefill removed: N requests sharing a 512-token system prompt + 32 unique tokens.

Token ids go straight to computed (max_tokens=1) through both real daemons. The model
positions computed for prompts come from `computed_prefill_tokens_total` (its delta over
the run); the ideal computes the system prompt once and each unique suffix once:
512 + N x 32. Naive serving computes N x 544.

Two arrivals, each from a cold cache with a fresh system prompt:
- primed: the first request completes alone, then the other N-1 arrive 32 at a time.
- burst: all N arrive at once, 32 streams in flight; the first wave is admitted
  before any block of the system prompt is committed, so it cannot hit.
"""

from __future__ import annotations

import time

from bench.context import BenchContext
from bench.driver import run_sync
from bench.report import BenchResult, Figure, Goal, median
from bench.stack import Stack
from bench.workloads import shared_prefix_prompts, unrelated_prompts

TITLE = "1. Redundant prefill removed"

PREFIX = 512
UNIQUE = 32
CONCURRENCY = 32


def run(ctx: BenchContext) -> BenchResult:
    num_requests = 100 if ctx.quick else 1000
    repeats = 1 if ctx.quick else 3
    ideal = PREFIX + num_requests * UNIQUE
    naive = num_requests * (PREFIX + UNIQUE)
    rows: dict[str, list[dict]] = {"primed": [], "burst": []}
    with Stack(ctx.scratch("prefill"), threads=ctx.threads) as stack:
        run_sync(stack.computed_address, unrelated_prompts(99, 4, PREFIX + UNIQUE), 1, 4)  # warm-up
        for rep in range(repeats):
            for arrival in ("primed", "burst"):
                seed = 1000 * rep + (1 if arrival == "primed" else 2)
                prompts = shared_prefix_prompts(seed, num_requests, PREFIX, UNIQUE)
                before = stack.metrics()["computed_prefill_tokens_total"]
                started = time.perf_counter()
                if arrival == "primed":
                    first = run_sync(stack.computed_address, prompts[:1], 1, 1)
                    rest = run_sync(stack.computed_address, prompts[1:], 1, CONCURRENCY)
                    cached = first.num_cached_tokens + rest.num_cached_tokens
                else:
                    cached = run_sync(stack.computed_address, prompts, 1, CONCURRENCY).num_cached_tokens
                wall = time.perf_counter() - started
                computed = stack.metrics()["computed_prefill_tokens_total"] - before
                rows[arrival].append({"computed": computed, "cached": cached, "wall": wall})

    def summary(arrival: str) -> tuple[float, float, float, float]:
        computed = median(r["computed"] for r in rows[arrival])
        wall = median(r["wall"] for r in rows[arrival])
        return computed, computed / ideal, 1 - computed / naive, num_requests / wall

    p_computed, p_ratio, p_removed, p_rps = summary("primed")
    b_computed, b_ratio, b_removed, b_rps = summary("burst")
    figures = [
        Figure("prefill computed ÷ ideal (primed)", round(p_ratio, 3), "", Goal("==", 1.0)),
        Figure("share of naive prefill removed (primed)", round(p_removed, 3)),
        Figure("prefill computed ÷ ideal (cold burst)", round(b_ratio, 3), "", Goal("==", 1.0)),
        Figure("share of naive prefill removed (cold burst)", round(b_removed, 3)),
    ]
    header = (
        "| arrival | prefill tokens computed (median) | ideal | naive | ÷ ideal | worst ÷ ideal | "
        "naive removed | requests/s |"
    )
    table = [header, "|---|---|---|---|---|---|---|---|"]
    worst = {a: max(r["computed"] for r in rows[a]) / ideal for a in rows}
    for name, arrival, (computed, ratio, removed, rps) in (
        ("primed", "primed", (p_computed, p_ratio, p_removed, p_rps)),
        ("cold burst", "burst", (b_computed, b_ratio, b_removed, b_rps)),
    ):
        table.append(
            f"| {name} | {computed:,.0f} | {ideal:,} | {naive:,} | {ratio:.3f} | {worst[arrival]:.3f} | "
            f"{removed:.1%} | {rps:.0f} |"
        )
    details = (
        f"{num_requests:,} requests, {PREFIX}-token system prompt + {UNIQUE} unique tokens each, "
        f"max_tokens=1, {CONCURRENCY} streams in flight, default model, {repeats} repetition(s) "
        f"(fresh system prompt each), medians.\n\n" + "\n".join(table) + "\n\n" + _why_burst(worst["burst"])
    )
    return BenchResult("prefill", TITLE, figures, details)


def _why_burst(worst: float) -> str:
    if worst <= 1.0 + 1e-9:
        return "In every repetition a cold burst also computed the system prompt once."
    return (
        "A cold burst depends on arrival timing: the requests that reach computed before the first "
        "prefill step is scheduled are admitted in the same step, before any block of the system prompt "
        "is computed and committed, so each of them computes the prompt (blockd has nothing to hit yet, "
        "and the scheduler does not hold back a request whose prefix a running request is about to "
        "commit). The worst repetition shows how much that cost."
    )
