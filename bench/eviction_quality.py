"""6. Eviction quality: hit tokens of blockd's policies against LRU and Belady's optimum.

Seven seeded traces, each replayed one request at a time under memory pressure (pools
of 2-25% of the trace's distinct blocks) through the real directory core
(bench.directory_replay) with each shipped policy, through a vLLM-style block pool
(bench.vllm_policy), and through Belady's offline optimum on the prefix tree
(bench.belady):

- zipf: prompt families with Zipf popularity + unique suffixes (bench.zipf_trace);
- chat: 24 interleaved multi-turn conversations (bench.retention_traces), where the
  next use of a block does not depend on how often it was used: recency wins;
- one-off: 70% unique requests among hot Zipf families (bench.retention_traces);
- conversation: production-like chat matched to the statistics issue 44 publishes for
  a production conversation trace (76% of blocks used once, median reuse gap ~6,000
  blocks, twice-used blocks ~42% of hits; bench.trace_statistics measures ours and
  the report prints them); mostly two-turn conversations after long think times;
- long-conversation: the earlier chat preset, longer conversations (3 turns on
  average, geometric) and system prompts, about half the blocks used once;
- agent: agentic tool calls over a shared tool-definition prompt, a heavy one-off
  share and long reuse gaps (the tools take a while);
- few-shot: a fixed few-shot set where every block recurs.

Every figure is hit tokens ÷ the optimum's (or ÷ lru's, or ÷ the best other shipped
policy's) on the same trace and pool, measured side by side in this run.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.belady import ReplayResult, replay_belady
from bench.context import BenchContext
from bench.directory_replay import replay_directory
from bench.hindsight_rules import best_rule, class_oracle, grid, replay_ranked
from bench.report import BenchResult, Figure, Goal
from bench.retention_traces import (
    ConversationSpec,
    FewShotSpec,
    OneOffSpec,
    agent_spec,
    conversation_spec,
    distinct_blocks,
    long_conversation_spec,
    make_conversation_trace,
    make_few_shot_trace,
    make_one_off_trace,
    make_session_trace,
)
from bench.trace_statistics import trace_statistics
from bench.vllm_policy import replay_vllm
from bench.zipf_trace import Trace, TraceSpec, make_trace
from blockd.eviction import DEFAULT_POLICY

TITLE = "6. Eviction quality"

BLOCK_SIZE = 16
GOAL_OF_OPTIMUM = 0.6  # the default, worst trace and pool (issue 14)
GOAL_OF_LRU = 0.98  # the default never more than 2% below lru (issues 14, 44)
GOAL_OF_BEST_OTHER = 0.98  # ... nor below the best other shipped policy (issue 44)
GOAL_CONVERSATION = 1.5  # the default ÷ lru on the conversation trace, pool 2% (issue 44)
POOL_SHARES = (0.02, 0.05, 0.10, 0.25)
# Shipped policies measured (`+seen2` of the ungated one as well would add a column,
# not an idea: lru+seen2 stands for the seen-twice rule).
OTHERS = ("adaptive-ungated", "lru", "lru+seen2", "lfu", "lfuda")
# Measured beside them, not counted as "other shipped": adaptive-sim (opt-in) follows the
# best of adaptive, lfu, lru+seen2 and lfuda by miniature simulation (blockd.minisim), at
# ~2.2x blockd's CPU per admission (bench.blockd_inprocess), so it is no default.
EXPERIMENTS = ("adaptive-sim",)
POLICIES = (DEFAULT_POLICY, *OTHERS, *EXPERIMENTS)
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

    @property
    def best_other(self) -> str:
        return max(OTHERS, key=lambda name: self.results[name].hit_tokens)


def traces(quick: bool) -> dict[str, Trace]:
    n = 600 if quick else 4_000
    return {
        "zipf": make_trace(TraceSpec(num_requests=n, seed=0)),
        "chat": make_conversation_trace(ConversationSpec(num_requests=n, seed=0)),
        "one-off": make_one_off_trace(OneOffSpec(num_requests=n, seed=0)),
        "conversation": make_session_trace(conversation_spec(n)),
        "long-conversation": make_session_trace(long_conversation_spec(n)),
        "agent": make_session_trace(agent_spec(n)),
        "few-shot": make_few_shot_trace(FewShotSpec(num_requests=n, seed=0)),
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
            one_offs = [family < 0 for family in trace.family_ids]
            if any(one_offs):  # the traces with one-off (one-shot) requests
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

    worst_other = min(cells, key=lambda c: c.of(default, c.best_other))
    smallest = min(c.share for c in cells)
    conversation = next(c for c in cells if c.trace == "conversation" and c.share == smallest)
    figures = [
        Figure(
            f"default ({default}) ÷ lru, worst ({where(worst_lru)})",
            round(worst_lru.of(default, "lru"), 3),
            "",
            Goal(">=", GOAL_OF_LRU),
        ),
        Figure(
            f"default ({default}) ÷ lru, conversation, pool {conversation.share:.0%}",
            round(conversation.of(default, "lru"), 3),
            "",
            Goal(">=", GOAL_CONVERSATION),
        ),
        Figure(
            f"default ({default}) ÷ best other shipped policy, worst "
            f"({where(worst_other)}: {worst_other.best_other})",
            round(worst_other.of(default, worst_other.best_other), 3),
            "",
            Goal(">=", GOAL_OF_BEST_OTHER),
        ),
        Figure(
            f"default ({default}) ÷ optimum, worst ({where(worst_opt)})",
            round(worst_opt.of(default, "opt"), 3),
            "",
            Goal(">=", GOAL_OF_OPTIMUM),
        ),
        Figure(f"default ({default}) ÷ lru, best ({where(best_lru)})", round(best_lru.of(default, "lru"), 3)),
    ]
    if READ_ONLY in conversation.results:  # what a client hint reaches where the server cannot tell
        figures.append(
            Figure(
                f"{READ_ONLY} ÷ lru, conversation, pool {conversation.share:.0%}",
                round(conversation.of(READ_ONLY, "lru"), 3),
            )
        )
    # The ceiling of rules that see what blockd sees (bench.hindsight_rules): on the same cell,
    # the best of a grid of class horizons chosen with hindsight, and the class oracle.
    trace = traces(ctx.quick)["conversation"]
    lru_hits = conversation.results["lru"].hit_tokens
    rule, best = best_rule(trace.prompts, conversation.pool, BLOCK_SIZE, grid(full=False))
    oracle = replay_ranked(trace.prompts, conversation.pool, BLOCK_SIZE, class_oracle(trace.family_ids))
    figures += [
        Figure(
            f"best rule on hit prefix + fresh run, chosen with hindsight, ÷ lru, conversation, "
            f"pool {conversation.share:.0%}",
            round(best.hit_tokens / max(1, lru_hits), 3),
        ),
        Figure(
            f"class oracle (each request's true kind) ÷ lru, conversation, pool {conversation.share:.0%}",
            round(oracle.hit_tokens / max(1, lru_hits), 3),
        ),
    ]
    # measured on the full run's cell (4,000 requests, 2%): the 288 rules' best is this grid's
    full_grid = "" if ctx.quick else " (the full grid of 288 rules, `--full`, found no better)"
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

    summary = [
        (
            "| trace | pool (share of distinct blocks) | optimum hit rate | default hit rate | default ÷ optimum "
            "| default ÷ lru | best other shipped | default ÷ best other |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        other = c.best_other
        summary.append(
            f"| {c.trace} | {c.pool:,} ({c.share:.0%}) | {c.results['opt'].hit_rate:.3f} "
            f"| {c.results[default].hit_rate:.3f} | {c.of(default, 'opt'):.3f} | {c.of(default, 'lru'):.3f} "
            f"| {other} | {c.of(default, other):.3f} |"
        )

    described = []
    for name, trace in traces(ctx.quick).items():
        mean = sum(map(len, trace.prompts)) / len(trace.prompts)
        distinct = distinct_blocks(trace.prompts, BLOCK_SIZE)
        shape = trace_statistics(trace.prompts, BLOCK_SIZE).describe()
        described.append(
            f"{name} ({len(trace.prompts):,} requests, mean prompt {mean:.0f} tokens, {distinct:,} distinct "
            f"blocks; {shape})"
        )
    plot = "eviction_quality.png"
    _plot(cells, ctx.plot_dir / plot)
    details = (
        f"Traces (seed 0, block size {BLOCK_SIZE}): {'; '.join(described)}. One request at a time: admit, "
        "commit every full block, release. Hit rates count full-block hit tokens ÷ prompt tokens.\n\n"
        "The default against the optimum, lru and the best other shipped policy (same trace, same pool):\n\n"
        + "\n".join(summary)
        + "\n\nHit tokens ÷ Belady's optimum (same trace, same pool):\n\n"
        + table("opt")
        + "\n\nHit tokens ÷ lru's (same trace, same pool):\n\n"
        + table("lru")
        + "\n\n"
        f"`{default}` (the default) is `adaptive-ungated` behind an admission gate "
        "(blockd.eviction.GatedPolicy): a block whose key the pool has not seen before (its ghost table "
        "and a key memory of 8x the pool at 3 bytes per tracked key, blockd.admission) is on probation and "
        "goes before admitted blocks released up to a penalty earlier; the penalty is set from the ghost "
        "returns of the two sides' victims (admitted over probation return rate), closed where probation "
        "victims never come back, open where they come back about as often. `adaptive-ungated` is LRU plus a "
        "frequency bonus that each use class earns only when the ghost table shows its evicted blocks "
        "coming back more often than one-use blocks, a horizon of bonus worth at least 128 releases, "
        "and that ages or favours one-use blocks by the length of the uncached run their request computed "
        "(log2 classes), each class against the other one-use blocks: aged where the ghost table shows its "
        "blocks coming back at most half as often (long fresh runs: pasted one-shot documents), up to 2 "
        "horizons longer where they come back more often (a conversation's opening); "
        "`lru+seen2`: blocks used once are evicted before any "
        f"block used twice; `{READ_ONLY}`: the default with the trace's one-off (one-shot) requests sent with "
        "cache_policy READ_ONLY (their new blocks are never indexed), as a client that knows they are "
        "one-offs would (a conversation's last turn is never reused either, but no client knows it is last).\n\n"
        "What the conversation trace at the smallest pool allows a policy that sees what blockd sees "
        "(`python -m bench.hindsight_rules`): requests sorted by their hit prefix and fresh run into fresh "
        "starts, long fresh runs and continuations, each class a horizon, leaf-first; the best of a grid "
        f"chosen on this very trace ({rule}) reached "
        f"{best.hit_tokens / max(1, lru_hits):.3f}x lru{full_grid}, where knowing each request's kind "
        "(one-shot, a session's first request, a later one) "
        f"reaches {oracle.hit_tokens / max(1, lru_hits):.3f}x. A conversation's opening and a one-shot "
        "document look the same to the server (a short system prompt, then a fresh run of overlapping "
        "lengths), and telling them apart is what the gap between the two is."
    )
    return BenchResult("eviction", TITLE, figures, details, [plot])


def _plot(cells: list[Cell], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(c.trace for c in cells))
    cols = 3
    rows_n = -(-len(names) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.8 * rows_n), squeeze=False)
    for ax, name in zip(axes.flat, names):
        rows = [c for c in cells if c.trace == name]
        shares = [c.share * 100 for c in rows]
        for key, label in (
            ("opt", "Belady optimum"),
            (DEFAULT_POLICY, f"{DEFAULT_POLICY} (default)"),
            ("adaptive-ungated", "adaptive-ungated"),
            ("lru", "lru"),
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
