"""6. Eviction quality: hit tokens of blockd's policies against LRU and Belady's optimum.

Three seeded traces, each replayed one request at a time under memory pressure
(pools of 2-25% of the trace's distinct blocks) through the real directory core
(bench.directory_replay) with each policy, through a vLLM-style block pool
(bench.vllm_policy), and through Belady's offline optimum on the prefix tree
(bench.belady):

- zipf: prompt families with Zipf popularity + unique suffixes (bench.zipf_trace);
- chat: interleaved multi-turn conversations (bench.retention_traces), where the
  next use of a block does not depend on how often it was used: recency wins;
- one-off: 70% unique requests among hot Zipf families (bench.retention_traces).

Every figure is hit tokens ÷ the optimum's (or ÷ lru's) on the same trace and pool,
measured side by side in this run. `+seen2` is a policy under the seen-twice
admission rule (blockd.eviction.SeenTwice: blocks used once go first).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.belady import ReplayResult, replay_belady
from bench.context import BenchContext
from bench.directory_replay import replay_directory
from bench.report import BenchResult, Figure, Goal
from bench.retention_traces import (
    ConversationSpec,
    OneOffSpec,
    distinct_blocks,
    make_conversation_trace,
    make_one_off_trace,
)
from bench.vllm_policy import replay_vllm
from bench.zipf_trace import Trace, TraceSpec, make_trace
from blockd.eviction import DEFAULT_POLICY

TITLE = "6. Eviction quality"

BLOCK_SIZE = 16
GOAL_OF_OPTIMUM = 0.6  # the default, worst trace and pool (issue 14)
GOAL_OF_LRU = 0.98  # the default never more than 2% below lru
POOL_SHARES = (0.02, 0.05, 0.10, 0.25)
POLICIES = (DEFAULT_POLICY, f"{DEFAULT_POLICY}+seen2", "lru", "lru+seen2", "lfu", "lfuda")
READ_ONLY = "read-only one-offs"  # the default, one-offs sent with cache_policy READ_ONLY
VLLM = "vLLM-style"


@dataclass
class Cell:
    trace: str
    share: float
    pool: int
    results: dict[str, ReplayResult]

    def of(self, name: str, base: str) -> float:
        return self.results[name].hit_tokens / max(1, self.results[base].hit_tokens)


def traces(quick: bool) -> dict[str, Trace]:
    n = 600 if quick else 4_000
    return {
        "zipf": make_trace(TraceSpec(num_requests=n, seed=0)),
        "chat": make_conversation_trace(ConversationSpec(num_requests=n, seed=0)),
        "one-off": make_one_off_trace(OneOffSpec(num_requests=n, seed=0)),
    }


def measure(quick: bool) -> list[Cell]:
    cells = []
    for name, trace in traces(quick).items():
        prompts = trace.prompts
        distinct = distinct_blocks(prompts, BLOCK_SIZE)
        largest = max(-(-len(p) // BLOCK_SIZE) for p in prompts)
        for share in (0.05, 0.25) if quick else POOL_SHARES:
            pool = max(int(distinct * share), largest)
            results = {"opt": replay_belady(prompts, pool, BLOCK_SIZE)}
            for policy in POLICIES:
                results[policy] = replay_directory(prompts, pool, BLOCK_SIZE, policy)
            results[VLLM] = replay_vllm(prompts, pool, BLOCK_SIZE)
            if name == "one-off":
                one_offs = [family < 0 for family in trace.family_ids]
                results[READ_ONLY] = replay_directory(
                    prompts, pool, BLOCK_SIZE, DEFAULT_POLICY, read_only=one_offs
                )
            cells.append(Cell(name, share, pool, results))
    return cells


def run(ctx: BenchContext) -> BenchResult:
    cells = measure(ctx.quick)
    default = DEFAULT_POLICY
    worst_opt = min(cells, key=lambda c: c.of(default, "opt"))
    worst_lru = min(cells, key=lambda c: c.of(default, "lru"))
    best_lru = max(cells, key=lambda c: c.of(default, "lru"))

    def where(cell: Cell) -> str:
        return f"{cell.trace}, pool {cell.share:.0%}"

    figures = [
        Figure(
            f"default ({default}) ÷ optimum, worst ({where(worst_opt)})",
            round(worst_opt.of(default, "opt"), 3),
            "",
            Goal(">=", GOAL_OF_OPTIMUM),
        ),
        Figure(
            f"default ({default}) ÷ lru, worst ({where(worst_lru)})",
            round(worst_lru.of(default, "lru"), 3),
            "",
            Goal(">=", GOAL_OF_LRU),
        ),
        Figure(f"default ({default}) ÷ lru, best ({where(best_lru)})", round(best_lru.of(default, "lru"), 3)),
    ]
    for other in ("lfu", "lfuda", "lru+seen2"):
        worst = min(cells, key=lambda c, o=other: c.of(o, "lru"))
        figures.append(Figure(f"{other} ÷ lru, worst ({where(worst)})", round(worst.of(other, "lru"), 3)))
    columns = [*POLICIES, VLLM, READ_ONLY]

    def table(base: str) -> str:
        head = f"| trace | pool (share of distinct blocks) | optimum hit rate | {' | '.join(columns)} |"
        lines = [head, "|" + "---|" * (3 + len(columns))]
        for c in cells:
            ratios = [f"{c.of(n, base):.3f}" if n in c.results else "" for n in columns]
            lines.append(
                f"| {c.trace} | {c.pool:,} ({c.share:.0%}) | {c.results['opt'].hit_rate:.3f} | {' | '.join(ratios)} |"
            )
        return "\n".join(lines)

    described = []
    for name, trace in traces(ctx.quick).items():
        mean = sum(map(len, trace.prompts)) / len(trace.prompts)
        distinct = distinct_blocks(trace.prompts, BLOCK_SIZE)
        described.append(
            f"{name} ({len(trace.prompts):,} requests, mean prompt {mean:.0f} tokens, {distinct:,} distinct blocks)"
        )
    plot = "eviction_quality.png"
    _plot(cells, ctx.plot_dir / plot)
    details = (
        f"Traces (seed 0, block size {BLOCK_SIZE}): {'; '.join(described)}. One request at a time: admit, "
        "commit every full block, release. Hit rates count full-block hit tokens ÷ prompt tokens.\n\n"
        "Hit tokens ÷ Belady's optimum (same trace, same pool):\n\n"
        + table("opt")
        + "\n\nHit tokens ÷ lru's (same trace, same pool):\n\n"
        + table("lru")
        + "\n\n"
        f"`{default}` (the default) is LRU plus a frequency bonus that each use class earns only when "
        "the ghost table shows its evicted blocks coming back more often than one-use blocks "
        "(blockd.eviction.AdaptivePolicy); `+seen2`: blocks used once are evicted before any block used "
        f"twice; `{READ_ONLY}`: the default with the trace's one-off requests sent with cache_policy "
        "READ_ONLY (their new blocks are never indexed), as a client that knows they are one-offs would."
    )
    return BenchResult("eviction", TITLE, figures, details, [plot])


def _plot(cells: list[Cell], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(c.trace for c in cells))
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = [c for c in cells if c.trace == name]
        shares = [c.share * 100 for c in rows]
        for key, label in (
            ("opt", "Belady optimum"),
            (DEFAULT_POLICY, f"{DEFAULT_POLICY} (default)"),
            ("lru", "lru"),
            ("lfu", "lfu"),
            ("lfuda", "lfuda"),
        ):
            ax.plot(shares, [c.results[key].hit_rate for c in rows], "o-", label=label)
        ax.set(
            xscale="log",
            xlabel="pool (% of distinct blocks)",
            ylabel="hit tokens ÷ prompt tokens",
            title=name,
        )
        ax.set_xticks(shares, [f"{s:g}" for s in shares])
        ax.minorticks_off()
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
