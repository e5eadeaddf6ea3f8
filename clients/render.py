"""Rich tables and trees for kvctl's human output (scripts use --json instead).

Strings that come from the daemons (model text, pool ids) are wrapped in Text so
that brackets in them are never read as rich markup. Ids and addresses are never
cut: their columns fold on a narrow terminal, and `output_console` renders at full
width when stdout is not a terminal (`kvctl pools | cat` shows every id whole).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from clients.prefix_tree import PrefixNode
from clients.types import (
    BlockEvent,
    BlockInfo,
    Completion,
    MissExplanation,
    PinResult,
    PoolInfo,
    PoolMatch,
    PoolStats,
    Stats,
    TierStats,
)

# What each miss reason means, in kvctl's words (blockd's MissReason).
MISS_REASONS = {
    "partial_block": "after the last full block: a partial block is never cached",
    "never_seen": "never cached in this pool, or evicted longer ago than it remembers",
    "evicted": "cached once, evicted",
    "flushed": "cached once, dropped by a flush",
    "not_stored": "computed before, but that request's cache policy (read_only / none) did not store it",
    "not_admitted": "cached once, never admitted (its key was not seen before), evicted before a second use",
    "other_salt": "cached, but under another cache salt (or none): tenants never share blocks",
    "other_namespace": "cached in a pool of another model, revision, dtype or adapter",
    "not_loaded": "only in a lower tier, which this admission did not load",
    "bypassed": "the request's cache policy was none: nothing was looked up",
}

# What each block event kind means (blockd's BlockEventKind), as docs/clients.md lists them.
EVENT_KINDS = {
    "stored": "blocks became findable (committed) in the device pool",
    "removed": "blocks stopped being findable in the tier (evicted, flushed or reused)",
    "cleared": "every block of the pool was dropped (lease lapsed or pool re-registered)",
    "gap": "events older than the replay window were lost; resync (kvctl blocks)",
    "demoted": "blocks left the device pool for a lower tier (host, or shared where they are findable now)",
    "loaded": "lower-tier blocks were copied into the device pool and are findable there",
}
_PREVIEW_HASHES = 4

_PREVIEW_CHARS = 60
_PREVIEW_TOKENS = 12
# Wide enough for any table: rich sizes a table to its content, never to this width.
_PIPE_WIDTH = 100_000


def output_console(stderr: bool = False) -> Console:
    """A console for human output; full width (no cut cells) when it is not a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else _PIPE_WIDTH
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


def add_columns(table: Table, names: Sequence[str], right: Sequence[str] = ()) -> None:
    """Adds columns by name (`right` ones right-aligned); a value too wide folds onto the next
    line, it is never cut: a cut pool id or count cannot be copied into the next command."""
    for name in names:
        table.add_column(name, justify="right" if name in right else "left", overflow="fold")


def plural(count: int, word: str, words: str | None = None) -> str:
    """ "1 block", "2 blocks", "0 blocks" (`words` for an irregular plural)."""
    return f"{count:,} {word if count == 1 else words or word + 's'}"


def short_hash(value: bytes | None) -> str:
    return value.hex()[:12] if value else "-"


def percent(part: float, whole: float) -> str:
    """part/whole as a percentage, one decimal, more where one would round to 0% or 100%.

    A share that is not the whole is never shown as 100.0% (8,096 of 8,100 is 99.95%),
    and a share that is not nothing is never shown as 0.0% (1 of 100,000 is 0.001%).
    """
    if not whole:
        return "-"
    value = 100.0 * part / whole
    digits = 1
    while 0 < part < whole and digits < 6 and float(f"{value:.{digits}f}") in (0.0, 100.0):
        digits += 1
    return f"{value:.{digits}f}%"


def preview_text(text: str, limit: int = _PREVIEW_CHARS) -> str:
    """One printable line: newlines shown as \\n, other control characters as "·"."""
    flat = "".join(c if c.isprintable() else "·" for c in text.replace("\n", "\\n"))
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def preview_tokens(token_ids: Sequence[int], limit: int = _PREVIEW_TOKENS) -> str:
    shown = ",".join(str(t) for t in token_ids[:limit])
    return shown + (f",… ({len(token_ids)})" if len(token_ids) > limit else "")


def event_line(event: BlockEvent) -> str:
    """One `kvctl watch` line: what the event carries (tier, block count and hashes, parent,
    tokens, block ids), each part only where the event has it."""
    parts = [f"#{event.sequence} {event.kind:<7} pool {event.pool_id or '-'}"]
    if event.tier:
        parts.append(f"tier {event.tier}")
    hashes = event.block_hashes
    if hashes:
        shown = " ".join(short_hash(h) for h in hashes[:_PREVIEW_HASHES])
        more = f" … (+{len(hashes) - _PREVIEW_HASHES})" if len(hashes) > _PREVIEW_HASHES else ""
        parts.append(f"{plural(len(hashes), 'block')} {shown}{more}")
    if event.parent_hash:
        parts.append(f"after {short_hash(event.parent_hash)}")
    if event.token_ids:
        parts.append(plural(len(event.token_ids), "token"))
    if event.block_ids:
        parts.append(f"block ids {preview_tokens(event.block_ids)}")
    if event.kind == "cleared":
        parts.append("every block of the pool dropped")
    elif event.kind == "gap":
        parts.append("earlier events were lost (older than the replay window): resync with kvctl blocks")
    return " · ".join(parts)


def usage_line(completion: Completion) -> Text:
    u = completion.usage
    line = Text(style="dim")
    line.append(f"prompt {u.prompt_tokens} tokens · cached ")
    line.append(f"{u.cached_tokens} ({percent(u.cached_tokens, u.prompt_tokens)})", style="bold green")
    line.append(f" · completion {u.completion_tokens} · TTFT ")
    line.append(f"{1000 * u.time_to_first_token_seconds:.1f} ms", style="bold")
    line.append(f" · total {1000 * u.total_time_seconds:.1f} ms · finish {completion.finish_reason}")
    if u.num_preemptions:
        line.append(f" · preempted {u.num_preemptions}x")
    line.append(f" · worker {completion.worker_address}")
    return line


def stats_table(stats: Stats) -> Table:
    """One row per PoolStats field; columns: the total, then each pool."""
    table = Table(title=f"blockd stats (last event #{stats.last_event_sequence})")
    table.add_column("field")
    table.add_column("total", justify="right", style="bold")
    columns: list[PoolStats] = [stats.total, *stats.pools]
    for pool in stats.pools:
        table.add_column(Text(pool.pool_id or "?"), justify="right", overflow="fold")
    for field in dataclasses.fields(PoolStats):
        if field.name in ("pool_id", "host", "shared", "miss_tokens", "eviction_policy"):
            continue
        table.add_row(field.name, *(f"{getattr(s, field.name):,}" for s in columns))
    table.add_row("eviction_policy", *(s.eviction_policy or "(mixed)" for s in columns))
    table.add_row(
        "hit rate (tokens)", *(percent(s.hit_tokens, s.queried_tokens) for s in columns), style="green"
    )
    for reason in MISS_REASONS:
        if any(reason in s.miss_tokens for s in columns):
            table.add_row(f"missed: {reason}", *(f"{s.miss_tokens.get(reason, 0):,}" for s in columns))
    for name in ("host", "shared"):
        if any(getattr(s, name) is not None for s in columns):
            for field in dataclasses.fields(TierStats):
                if field.name == "tier":
                    continue
                table.add_row(
                    f"{name} {field.name}",
                    *(_tier_cell(getattr(s, name), field.name) for s in columns),
                    style="cyan",
                )
    return table


def _tier_cell(tier: TierStats | None, name: str) -> str:
    if tier is None:
        return "-"
    value = getattr(tier, name)
    return f"{value * 1e6:,.1f} µs" if isinstance(value, float) else f"{value:,}"


def why_text(explanations: Sequence[MissExplanation], num_tokens: int) -> Text:
    """`kvctl why`: per pool, the cached prefix and why the rest is not cached."""
    if not explanations:
        return Text("no live pool: nothing is cached anywhere")
    text = Text()
    for e in explanations:
        text.append(f"{e.pool_id}", style="bold")
        text.append(
            f" ({e.worker_address or '-'}): {e.num_cached_tokens:,} of {num_tokens:,} tokens cached\n"
        )
        if e.reason is not None:
            line = f"  {e.num_missed_tokens:,} tokens from block {e.first_missing_block}: {e.reason} ({MISS_REASONS.get(e.reason, '')})"
            if e.evicted_by:
                line += f"; by {e.evicted_by}, {e.seconds_ago:.0f} s ago"
            if e.other_pool_ids:
                line += f"; cached in {', '.join(e.other_pool_ids)}"
            text.append(line + "\n")
        if e.num_partial_tokens:
            text.append(
                f"  {e.num_partial_tokens:,} tokens: partial_block ({MISS_REASONS['partial_block']})\n"
            )
        if e.reason is None and not e.num_partial_tokens:
            text.append("  every token is cached\n")
    text.rstrip()
    return text


def pools_table(pools: Sequence[PoolInfo]) -> Table:
    table = Table(title=plural(len(pools), "pool"))
    add_columns(
        table,
        ("pool", "worker", "model", "blocks", "free", "cached", "seqs", "hit rate", "lease"),
        right=("blocks", "free", "cached", "seqs", "hit rate", "lease"),
    )
    for p in pools:
        lease = f"{p.lease_remaining_seconds:.0f}s" if p.is_live else "lapsed"
        table.add_row(
            Text(p.pool_id),
            Text(p.worker_address or "-"),
            Text(f"{p.namespace.model_id} ({p.namespace.dtype})"),
            f"{p.num_blocks:,}×{p.block_size}",
            f"{p.stats.num_free_blocks:,}",
            f"{p.stats.num_cached_blocks:,}",
            str(p.stats.num_sequences),
            percent(p.stats.hit_tokens, p.stats.queried_tokens),
            Text(lease, style="green" if p.is_live else "red"),
        )
    return table


def blocks_table(blocks: Sequence[BlockInfo], num_total: int) -> Table:
    shown = plural(len(blocks), "cached block")
    table = Table(title=shown + (f" of {num_total:,}" if num_total > len(blocks) else ""))
    add_columns(
        table,
        ("pool", "block", "index", "hash", "parent", "refs", "pinned", "salted", "tokens"),
        right=("block", "index", "refs"),
    )
    for b in blocks:
        table.add_row(
            Text(b.pool_id),
            str(b.block_id),
            str(b.block_index),
            short_hash(b.block_hash),
            short_hash(b.parent_hash),
            str(b.ref_count),
            "yes" if b.is_pinned else "",
            "yes" if b.is_salted else "",
            preview_tokens(b.token_ids),
        )
    return table


def lookup_table(matches: Sequence[PoolMatch], num_tokens: int) -> Table:
    table = Table(title=f"cached prefix of a {num_tokens}-token prompt")
    add_columns(
        table,
        (
            "pool",
            "worker",
            "cached tokens",
            "of them in host tier",
            "in shared tier",
            "share",
            "load",
            "sequences",
        ),
        right=("cached tokens", "of them in host tier", "in shared tier", "share", "load", "sequences"),
    )
    for m in matches:
        table.add_row(
            Text(m.pool_id),
            Text(m.worker_address or "-"),
            str(m.num_cached_tokens),
            str(m.num_host_cached_tokens),
            str(m.num_shared_cached_tokens),
            percent(m.num_cached_tokens, num_tokens),
            f"{100 * m.load:.0f}%",
            str(m.num_sequences),
        )
    return table


def pin_text(pin: PinResult) -> Text:
    text = Text(
        f"pinned {plural(pin.num_pinned_tokens, 'token')} ({plural(pin.num_pinned_blocks, 'block')}) "
        f"for {pin.expires_in_seconds:.0f} s; pin id "
    )
    text.append(pin.pin_id, style="bold")
    return text


def prefix_tree(forest: dict[str, list[PrefixNode]], block_size: dict[str, int]) -> Tree:
    total = sum(len(list(n.walk())) for roots in forest.values() for n in roots)
    tree = Tree(f"cached prefixes ({plural(len(forest), 'pool')}, {plural(total, 'run')})")
    for pool_id, roots in forest.items():
        pool = tree.add(Text(f"pool {pool_id} (block size {block_size.get(pool_id, '?')})", style="bold"))
        stack = [(pool, root) for root in reversed(roots)]
        while stack:
            parent, node = stack.pop()
            branch = parent.add(_node_label(node))
            stack.extend((branch, child) for child in reversed(node.children))
    return tree


def _node_label(node: PrefixNode) -> Text:
    label = Text()
    ids = node.block_ids
    span = f"#{ids[0]}" if len(ids) == 1 else f"#{ids[0]}…#{ids[-1]} ({plural(len(ids), 'block')})"
    label.append(f"{span} ", style="cyan")
    if node.text is not None:
        label.append(f'"{preview_text(node.text)}"')
    else:
        label.append(f"[{preview_tokens(node.token_ids)}]")
    flags = []
    if node.max_ref_count:
        flags.append(f"refs {node.max_ref_count}")
    if node.num_pinned_blocks:
        flags.append("pinned")
    if node.is_salted:
        flags.append("salted")
    if node.is_orphan:
        flags.append("parent not cached")
    if flags:
        label.append(f"  ({', '.join(flags)})", style="dim")
    return label
