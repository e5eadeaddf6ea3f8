"""4. Directory overhead: share of engine wall time spent waiting on blockd, decode-heavy.

32 concurrent requests with short unique prompts (32 tokens), 128 output tokens each
(EOS ignored), through both daemons. From computed's counters, as deltas over the run:
`computed_directory_wait_seconds_total` ÷ the client's wall time of the run, and ÷
`computed_forward_seconds_total`. The wait counts only steps that could not run
without blockd's answer (admissions, a grow the step needs); commits, releases and
look-ahead grows travel while the model computes.
"""

from __future__ import annotations

from bench.context import BenchContext
from bench.driver import run_sync
from bench.report import BenchResult, Figure, Goal, median
from bench.stack import Stack
from bench.workloads import unrelated_prompts

TITLE = "4. Directory overhead"

GOAL = 0.02
NUM_REQUESTS = 32
PROMPT = 32
OUTPUT = 128


def run(ctx: BenchContext) -> BenchResult:
    repeats = 2 if ctx.quick else 5
    output = 32 if ctx.quick else OUTPUT
    samples = []
    with Stack(ctx.scratch("directory_overhead"), threads=ctx.threads) as stack:
        run_sync(stack.computed_address, unrelated_prompts(96, 4, PROMPT), 8, 4)  # warm-up
        for rep in range(repeats):
            before = stack.metrics()
            outcome = run_sync(
                stack.computed_address, unrelated_prompts(rep, NUM_REQUESTS, PROMPT), output, NUM_REQUESTS
            )
            after = stack.metrics()
            delta = {k: after[k] - before[k] for k in after if k.endswith("_total")}
            assert outcome.num_completion_tokens == NUM_REQUESTS * output
            samples.append(
                {
                    "wait": delta["computed_directory_wait_seconds_total"],
                    "forward": delta["computed_forward_seconds_total"],
                    "steps": delta["computed_steps_total"],
                    "wall": outcome.wall_s,
                }
            )
    of_wall = median(s["wait"] / s["wall"] for s in samples)
    of_forward = median(s["wait"] / s["forward"] for s in samples)
    wait_per_step_us = median(s["wait"] / s["steps"] * 1e6 for s in samples)
    figures = [
        Figure("directory wait ÷ wall time", round(of_wall, 4), "", Goal("<=", GOAL)),
        Figure("directory wait ÷ forward time", round(of_forward, 4)),
        Figure("directory wait per engine step (mean)", round(wait_per_step_us, 1), "µs"),
    ]
    rows = [
        "| repetition | wall (s) | forward (s) | directory wait (s) | steps | wait ÷ wall |",
        "|---|---|---|---|---|---|",
    ]
    rows += [
        f"| {i + 1} | {s['wall']:.2f} | {s['forward']:.2f} | {s['wait']:.4f} | {s['steps']:.0f} | "
        f"{s['wait'] / s['wall']:.2%} |"
        for i, s in enumerate(samples)
    ]
    details = (
        f"{NUM_REQUESTS} concurrent requests, {PROMPT}-token unique prompts, {output} output tokens "
        f"each, default model and computed flags; {repeats} repetitions, medians.\n\n" + "\n".join(rows)
    )
    return BenchResult("directory_overhead", TITLE, figures, details)
