"""Rich tables and trees for kvctl's human output (scripts use --json instead).

Strings that come from the daemons (model text, pool ids) are wrapped in Text so
that brackets in them are never read as rich markup.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from clients.prefix_tree import PrefixNode
from clients.types import BlockInfo, Completion, PinResult, PoolInfo, PoolMatch, PoolStats, Stats

_PREVIEW_CHARS = 60
_PREVIEW_TOKENS = 12


def short_hash(value: bytes | None) -> str:
    return value.hex()[:12] if value else "-"


def percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def preview_text(text: str, limit: int = _PREVIEW_CHARS) -> str:
    """One printable line: newlines shown as \\n, other control characters as "·"."""
    flat = "".join(c if c.isprintable() else "·" for c in text.replace("\n", "\\n"))
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def preview_tokens(token_ids: Sequence[int], limit: int = _PREVIEW_TOKENS) -> str:
    shown = ",".join(str(t) for t in token_ids[:limit])
    return shown + (f",… ({len(token_ids)})" if len(token_ids) > limit else "")


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
        table.add_column(Text(pool.pool_id or "?"), justify="right")
    for field in dataclasses.fields(PoolStats):
        if field.name == "pool_id":
            continue
        table.add_row(field.name, *(f"{getattr(s, field.name):,}" for s in columns))
    table.add_row("hit rate (tokens)", *(percent(s.hit_tokens, s.queried_tokens) for s in columns),
                  style="green")
    return table


def pools_table(pools: Sequence[PoolInfo]) -> Table:
    table = Table(title=f"{len(pools)} pool(s)")
    for name in ("pool", "worker", "model", "blocks", "free", "cached", "seqs", "hit rate", "lease"):
        table.add_column(name, justify="left" if name in ("pool", "worker", "model") else "right")
    for p in pools:
        lease = f"{p.lease_remaining_seconds:.0f}s" if p.is_live else "lapsed"
        table.add_row(Text(p.pool_id), Text(p.worker_address or "-"),
                      Text(f"{p.namespace.model_id} ({p.namespace.dtype})"),
                      f"{p.num_blocks:,}×{p.block_size}", f"{p.stats.num_free_blocks:,}",
                      f"{p.stats.num_cached_blocks:,}", str(p.stats.num_sequences),
                      percent(p.stats.hit_tokens, p.stats.queried_tokens),
                      Text(lease, style="green" if p.is_live else "red"))
    return table


def blocks_table(blocks: Sequence[BlockInfo], num_total: int) -> Table:
    title = f"{len(blocks)} cached block(s)" + (f" of {num_total}" if num_total > len(blocks) else "")
    table = Table(title=title)
    for name in ("pool", "block", "index", "hash", "parent", "refs", "pinned", "salted", "tokens"):
        table.add_column(name, justify="right" if name in ("block", "index", "refs") else "left")
    for b in blocks:
        table.add_row(Text(b.pool_id), str(b.block_id), str(b.block_index), short_hash(b.block_hash),
                      short_hash(b.parent_hash), str(b.ref_count), "yes" if b.is_pinned else "",
                      "yes" if b.is_salted else "", preview_tokens(b.token_ids))
    return table


def lookup_table(matches: Sequence[PoolMatch], num_tokens: int) -> Table:
    table = Table(title=f"cached prefix of a {num_tokens}-token prompt")
    for name in ("pool", "worker", "cached tokens", "share", "load", "sequences"):
        table.add_column(name, justify="left" if name in ("pool", "worker") else "right")
    for m in matches:
        table.add_row(Text(m.pool_id), Text(m.worker_address or "-"), str(m.num_cached_tokens),
                      percent(m.num_cached_tokens, num_tokens), f"{100 * m.load:.0f}%", str(m.num_sequences))
    return table


def pin_text(pin: PinResult) -> Text:
    text = Text(f"pinned {pin.num_pinned_tokens} tokens ({pin.num_pinned_blocks} blocks) "
                f"for {pin.expires_in_seconds:.0f} s; pin id ")
    text.append(pin.pin_id, style="bold")
    return text


def prefix_tree(forest: dict[str, list[PrefixNode]], block_size: dict[str, int]) -> Tree:
    total = sum(len(list(n.walk())) for roots in forest.values() for n in roots)
    tree = Tree(f"cached prefixes ({len(forest)} pool(s), {total} run(s))")
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
    span = f"#{ids[0]}" if len(ids) == 1 else f"#{ids[0]}…#{ids[-1]} ({len(ids)} blocks)"
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
