"""2. TTFT warm ÷ cold as the shared prefix grows (prefix + 64 new tokens), through gRPC.

For each prefix length and repetition: a fresh random prefix; cold = the first request
with it; warm = the same prefix + 64 different tokens, sent after the cold one finished
(its prefix blocks are committed). One request at a time, max_tokens=1; TTFT is timed
by the client (call -> first token); the warm request's TTFT inside computed (arrival
to first token, its usage) is shown beside it, the rest being gRPC both ways. computed
runs with --max-num-batched-tokens 8192 so a 4K prefill is one chunk. The 4,096-token
row is repeated on the tests' tiny model (tests/models.py: 3 layers, hidden 64), whose
forward is a few ms: there the TTFT is mostly what is not the model.

Where a warm request's time goes: computed's counters around each warm request give its
forward (the one forward of a max_tokens=1 request, thread hand-off included) and its
queue time (`computed_request_queue_seconds`: queued in the engine until its forward
starts, which for a lone request is the admission's Step to blockd, one round trip);
"inside computed" is the queue time plus the prefill (the forward and the engine's host
work around it), and its admission (`computed_request_admission_seconds`: received ->
queued, a token-id prompt's checks) and the rest of the TTFT are gRPC both ways and the
client. Beside each ratio, the work ratio (`bench.forward_work`): the warm forward's
multiply-adds over the cold one's, the least the ratio could be if the warm forward ran
at the cold one's rate and nothing else took time. At 4,096 + 64 on the default model it
is 0.024: a goal of 0.03 leaves 0.006 of the cold TTFT (about 1.6 ms) for every fixed
cost together, the admission's round trip to blockd and the client's call both ways
included, and asks the warm forward (64 rows over 4,160 keys) to run at the cold one's
rate. The forwards alone (warm forward ÷ cold forward, computed's counters around each)
show how far the warm forward is from that rate with every fixed cost left out.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from bench.context import BenchContext
from bench.driver import generate_one
from bench.forward_work import work_ratio
from bench.report import BenchResult, Figure, Goal, median
from bench.stack import Stack
from bench.workloads import VOCAB, shared_prefix_prompts, unrelated_prompts
from clients.aio_client import AsyncComputedClient
from computed.config import DEFAULT_MODEL_DIR
from computed.model.config import ModelConfig
from tools.tiny_models import make_tiny_model

TITLE = "2. TTFT warm ÷ cold"

NEW_TOKENS = 64
GOAL_AT_4K = 0.03  # issue 45: a cached 4,096-token prefix + 64 new tokens
TINY_VOCAB = 512  # tools/tiny_models.py's vocabulary


def run(ctx: BenchContext) -> BenchResult:
    sizes = [256, 1024] if ctx.quick else [256, 512, 1024, 2048, 4096]
    repeats = 3 if ctx.quick else 5
    args = ("--max-num-batched-tokens", "8192", "--num-blocks", "4096")
    with Stack(ctx.scratch("ttft"), *args, threads=ctx.threads) as stack:
        samples = asyncio.run(_measure(stack, sizes, repeats))
    tiny_size = max(sizes)
    tiny_model = make_tiny_model(ctx.scratch("ttft-tiny") / "llama", "llama", max_position_embeddings=8192)
    with Stack(ctx.scratch("ttft-tiny"), *args, model=tiny_model, threads=ctx.threads) as stack:
        tiny = asyncio.run(_measure(stack, [tiny_size], repeats, TINY_VOCAB))[tiny_size]
    default, tiny_config = ModelConfig.from_dir(DEFAULT_MODEL_DIR), ModelConfig.from_dir(tiny_model)
    rows = [
        (f"{size:,} + {NEW_TOKENS}", _row(samples[size]), work_ratio(default, size, NEW_TOKENS))
        for size in sizes
    ]
    rows.append(
        (
            f"{tiny_size:,} + {NEW_TOKENS}, tiny model",
            _row(tiny),
            work_ratio(tiny_config, tiny_size, NEW_TOKENS),
        )
    )
    figures = []
    for size, (_, row, work) in zip(sizes, rows):
        goal = Goal("<=", GOAL_AT_4K) if size == 4096 else None
        figures.append(Figure(f"TTFT warm ÷ cold, {size}-token prefix", round(row.ratio, 4), "", goal))
        if size == 4096:
            figures.append(
                Figure(
                    f"warm ÷ cold, the forwards alone (no gRPC, no blockd), {size}-token prefix",
                    round(row.forward_ratio, 4),
                )
            )
            figures.append(
                Figure(
                    f"work ratio warm ÷ cold (multiply-adds), {size}-token prefix: the least it could be",
                    round(work, 4),
                )
            )
    figures.append(
        Figure(f"TTFT warm ÷ cold, {tiny_size}-token prefix, tiny model", round(rows[-1][1].ratio, 4))
    )
    table = [
        (
            "| shared prefix | cold TTFT (ms) | warm TTFT (ms) | warm: admission (ms) | warm, inside computed "
            "(ms) | of which the queue (ms) | of which the forward (ms) | warm ÷ cold | cold forward (ms) "
            "| warm ÷ cold, forwards alone | work ratio (multiply-adds) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    table += [
        f"| {name} | {r.cold * 1e3:.1f} | {r.warm * 1e3:.1f} | {r.admission * 1e3:.2f} | {r.inside * 1e3:.1f} "
        f"| {r.queue * 1e3:.2f} | {r.forward * 1e3:.1f} | {r.ratio:.4f} | {r.cold_forward * 1e3:.1f} "
        f"| {r.forward_ratio:.4f} | {work:.4f} |"
        for name, r, work in rows
    ]
    plot = "ttft_warm_over_cold.png"
    _plot(
        [(size, row.cold, row.warm, row.ratio) for size, (_, row, _) in zip(sizes, rows)], ctx.plot_dir / plot
    )
    details = (
        f"Prefix lengths {', '.join(map(str, sizes))} + {NEW_TOKENS} new tokens; {repeats} fresh "
        f"prefixes per length, medians (the ratio is the median of per-prefix ratios); default "
        f"model, and the tests' tiny llama (3 layers, hidden 64, 8,192 positions) at "
        f'{tiny_size:,}; computed `{" ".join(args)}`. "inside computed": the warm request\'s '
        f"arrival to its first token as computed times it (its usage): its queue time (for a lone "
        f"request, the admission's Step to blockd) plus its prefill, the forward and the host work "
        f"around it; its admission (received -> queued) and the rest of its TTFT are gRPC both ways "
        f"and the client. \"forwards alone\": the warm request's forward over the cold one's "
        f"(computed's forward seconds around each): the ratio with every fixed cost left out, to set "
        f"beside the work ratio (the warm forward's efficiency against the cold one's) and the goal."
        f"\n\n" + "\n".join(table)
    )
    return BenchResult("ttft", TITLE, figures, details, [plot])


class Sample(NamedTuple):
    """One prefix's requests, in seconds: the cold and warm TTFT (client), the warm one
    inside computed, and the warm request's forward, queue and admission times (computed's
    counters)."""

    cold: float
    warm: float
    inside: float
    forward: float
    queue: float
    admission: float
    cold_forward: float


class Row(NamedTuple):
    """Medians over a size's samples; `ratio` is the median of per-prefix warm ÷ cold."""

    cold: float
    warm: float
    inside: float
    forward: float
    queue: float
    admission: float
    ratio: float
    cold_forward: float
    forward_ratio: float  # median of per-prefix warm forward ÷ cold forward


def _row(samples: list[Sample]) -> Row:
    return Row(
        median(s.cold for s in samples),
        median(s.warm for s in samples),
        median(s.inside for s in samples),
        median(s.forward for s in samples),
        median(s.queue for s in samples),
        median(s.admission for s in samples),
        median(s.warm / s.cold for s in samples),
        median(s.cold_forward for s in samples),
        median(s.forward / s.cold_forward for s in samples),
    )


# computed's counters read around each warm request: its forward, queue and admission.
_COUNTERS = (
    "computed_forward_seconds_total",
    "computed_request_queue_seconds_sum",
    "computed_request_admission_seconds_sum",
)


def _counters(stack: Stack) -> tuple[float, ...]:
    """computed's seconds in forwards, queued and admitting, so far."""
    metrics = stack.metrics()
    return tuple(metrics[name] for name in _COUNTERS)


async def _measure(
    stack: Stack, sizes: list[int], repeats: int, vocab: int = VOCAB
) -> dict[int, list[Sample]]:
    """Per size, per repetition: one `Sample`. One request at a time, so the counters'
    deltas around the warm request are its own."""
    async with AsyncComputedClient(stack.computed_address) as client:
        for prompt in unrelated_prompts(98, 2, max(sizes) + NEW_TOKENS, vocab):  # warm-up: largest shapes
            await generate_one(client, prompt, 1)
        samples: dict[int, list[Sample]] = {size: [] for size in sizes}
        for rep in range(repeats):
            for size in sizes:  # interleaved, so noise spreads over every size
                seed = 10_000 * rep + size
                cold_prompt, warm_prompt = shared_prefix_prompts(seed, 2, size, NEW_TOKENS, vocab)
                ahead = _counters(stack)
                cold = await generate_one(client, cold_prompt, 1)
                before = _counters(stack)
                warm = await generate_one(client, warm_prompt, 1)
                forward, queue, admission = (a - b for a, b in zip(_counters(stack), before, strict=True))
                assert cold.cached_tokens == 0, f"a fresh prefix hit {cold.cached_tokens} tokens"
                assert warm.cached_tokens >= size - size % 16, f"warm hit only {warm.cached_tokens}"
                samples[size].append(
                    Sample(
                        cold.ttft_s,
                        warm.ttft_s,
                        warm.server_ttft_s,
                        forward,
                        queue,
                        admission,
                        before[0] - ahead[0],
                    )
                )
        return samples


def _plot(rows: list[tuple[int, float, float, float]], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter, NullLocator

    sizes = [r[0] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(sizes, [r[1] * 1e3 for r in rows], "o-", label="cold (fresh prefix)")
    left.plot(sizes, [r[2] * 1e3 for r in rows], "o-", label="warm (cached prefix)")
    left.set(
        xscale="log",
        yscale="log",
        xlabel="shared prefix (tokens) + 64 new",
        ylabel="time to first token (ms)",
        title="TTFT through gRPC",
    )
    left.legend()
    right.plot(sizes, [r[3] for r in rows], "o-", color="C2", label="warm ÷ cold")
    right.axhline(GOAL_AT_4K, color="grey", linestyle="--", label=f"goal at 4,096: ≤ {GOAL_AT_4K}")
    right.set(
        xscale="log",
        yscale="log",
        xlabel="shared prefix (tokens) + 64 new",
        ylabel="warm ÷ cold",
        title="TTFT ratio",
    )
    right.legend()
    for ax in (left, right):
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
