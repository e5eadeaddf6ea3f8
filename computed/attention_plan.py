"""Plan one step's attention on the host: which queries read which pool slots, grouped
into a few padded tiles (pure: numpy only, no torch, no I/O).

The run half (`computed.attention`) issues a fixed number of kernel calls per tile, so a
layer's kernel count depends on the tiles' shapes, never on how many sequences a step
carries. Plan once per step, run per layer (FlashInfer's plan/run split).

**Work items.** Every query row of the step gets one or more *partials*: attention over
one contiguous run of its context. The partials of a row are merged exactly through
their log-sum-exp, so splitting a context changes nothing but float rounding.

- *Shared segment* (cascade): a run of cached blocks that the block tables of two or more
  sequences hold in common, at the same depth. All member queries attend to it in one
  item, so its K/V is read once however many sequences share it. Segments nest: the
  tables form a trie (a system prompt shared by all, a document shared by some, ...),
  and every maximal run of blocks with the same set of members is one segment.
  A segment read by decode rows only is worth its own item when it has enough members
  and saves enough reads (members x keys), as the step's `DecodeCascade` says: a decode
  row's private context runs a kernel that reads keys straight from the pool, where a few
  rows re-reading a short prefix (from cache) cost less than the segment's gather, kernel
  call and merge. A dropped segment takes its nested segments with it (they would start
  after a gap).
- *Private context*: the rest of a sequence's cached context, after its deepest segment.
- *New tokens*: a sequence's new positions attend causally to each other (a square,
  top-left-aligned causal item: no mask). A single new token (a decode row) instead joins
  its private context item (it sees everything, itself included); those items are built
  for all decode rows at once.

**Visibility.** A segment or private-context item holds only keys strictly before every
one of its queries (whole blocks before `num_computed_tokens`), so only padding is masked.

**Tiles.** Items are grouped by the next power of two of their query and key lengths and
padded to the group's largest: padding wastes at most half of a tile, and a step has at
most log2(queries) x log2(keys) tiles of each kind. Decode rows whose private contexts
pad to at most twice their keys make one tile whatever their lengths (a decode step's
rows usually do: one kernel call a layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# A segment needs this many member sequences to be worth its own item.
MIN_SEGMENT_MEMBERS = 2


@dataclass(frozen=True)
class DecodeCascade:
    """When a segment whose members are all decode rows gets its own item (read once for
    all of them, then merged) rather than being read by each row in its private context:
    from `min_members` members and `min_reads` members x keys. What pays depends on the
    kernels (computed.attention's `decode_cascade` chooses); the default keeps every
    segment, from two members."""

    min_members: int = MIN_SEGMENT_MEMBERS
    min_reads: int = 0

    def __post_init__(self) -> None:
        assert self.min_members >= MIN_SEGMENT_MEMBERS, f"a segment has two members or more: {self}"
        assert self.min_reads >= 0, f"a negative read budget: {self}"

    @property
    def keeps_every_segment(self) -> bool:
        return self.min_members <= MIN_SEGMENT_MEMBERS and self.min_reads <= 0


EVERY_SEGMENT = DecodeCascade()


@dataclass(frozen=True)
class TilePlan:
    """Items of like shape, padded: I items x Qm query rows x Lm keys.

    Invariants: `query_rows` and `key_slots` index real rows/slots (padding repeats a real
    one); `valid` lists, in item-major order, the padded positions (i * Qm + q) that are
    real queries, and `valid_rows` the flat query row each of them belongs to. A causal
    tile has Qm == Lm and item i's query q sees its keys 0..q; otherwise every query sees
    keys `0 .. key_lens[i] - 1` of its item.
    """

    query_rows: np.ndarray  # (I, Qm) int64 flat query rows
    key_slots: np.ndarray  # (I, Lm) int64 pool slots (block_id * block_size + offset)
    key_lens: np.ndarray  # (I,) int64 real keys per item
    causal: bool
    valid: np.ndarray  # (P,) int64 positions in the flattened (I * Qm) results that are real
    valid_rows: np.ndarray  # (P,) int64 flat query row of each real result


@dataclass(frozen=True)
class Segment:
    """A run of blocks `[first_block, first_block + num_blocks)` of every member's table,
    the same physical blocks in all of them (so the same K/V)."""

    span_indices: tuple[int, ...]
    first_block: int
    num_blocks: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class AttentionPlan:
    tiles: tuple[TilePlan, ...]
    segments: tuple[Segment, ...]
    # (T, depth) int64 when some query row has more than one partial: row r's partials
    # are rows merge_index[r] of the tiles' whole results (I * Qm rows each, padding
    # included) concatenated in tile order, R (their total) marking "no partial".
    merge_index: np.ndarray | None
    # The last `num_decode_tiles` tiles are the decode rows' private contexts.
    num_decode_tiles: int = 0

    @property
    def needs_merge(self) -> bool:
        return self.merge_index is not None


def find_segments(tables: np.ndarray, shareable: np.ndarray) -> list[Segment]:
    """Shared runs of the block-table trie.

    tables (S, N) int64 block ids, shareable (S,) how many leading blocks of each row may
    be shared (whole blocks before its first query). Returns the maximal runs of at least
    one block held at the same depth by >= MIN_SEGMENT_MEMBERS rows, parents before children.
    """
    num_spans, width = tables.shape
    if num_spans < MIN_SEGMENT_MEMBERS or width == 0:
        return []
    # Blocks past a row's shareable prefix become a value unique to that row, so they
    # never match anything: the trie walk then only has to compare columns.
    columns = np.arange(width)[None, :]
    keyed = np.where(columns < shareable[:, None], tables, -1 - np.arange(num_spans)[:, None])
    segments: list[Segment] = []
    pending = [(np.flatnonzero(shareable > 0), 0)]
    while pending:
        members, depth = pending.pop()
        if len(members) < MIN_SEGMENT_MEMBERS or depth >= width:
            continue
        rest = keyed[members, depth:]
        differs = (rest != rest[0]).any(axis=0)
        run = int(differs.argmax()) if differs.any() else rest.shape[1]
        if run > 0 and rest[0, 0] >= 0:
            segments.append(Segment(tuple(members.tolist()), depth, run, tuple(rest[0, :run].tolist())))
        depth += run
        if depth >= width:
            continue
        column = keyed[members, depth]
        values, counts = np.unique(column, return_counts=True)
        for value in values[(counts >= MIN_SEGMENT_MEMBERS) & (values >= 0)][::-1]:
            pending.append((members[column == value], depth))
    segments.sort(key=lambda s: (s.first_block, s.span_indices))
    return segments


@dataclass
class _Item:
    rows: np.ndarray  # (Q,) flat query rows
    slots: np.ndarray  # (L,) pool slots
    causal: bool


def plan_attention(
    query_starts: Sequence[int],
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    tables: np.ndarray,
    block_size: int,
    cascade: DecodeCascade = EVERY_SEGMENT,
) -> AttentionPlan:
    """The tiles of one step. `tables` (S, N) int64 block ids (padding past a row's blocks
    is never read); span i's new queries are flat rows `query_starts[i] ...` at positions
    `context_lens[i] - query_lens[i] ...`. A segment whose members are all decode rows is
    kept only as `cascade` says."""
    starts = np.asarray(query_starts, dtype=np.int64)
    lens = np.asarray(query_lens, dtype=np.int64)
    contexts = np.asarray(context_lens, dtype=np.int64)
    firsts = contexts - lens
    shareable = firsts // block_size
    if cascade.keeps_every_segment:
        segments = find_segments(tables, shareable)
    elif (lens == 1).all() and (
        len(lens) < cascade.min_members or len(lens) * int(shareable.max()) * block_size < cascade.min_reads
    ):
        segments = []  # decode rows only, too few for any segment to pay: no search
    else:
        segments = _worth_cascading(find_segments(tables, shareable), lens, block_size, cascade)
    covered = _covered(segments, len(starts))
    offsets = np.arange(block_size, dtype=np.int64)
    items: list[_Item] = []
    for seg in segments:
        members = np.asarray(seg.span_indices)
        rows = _rows(starts[members], lens[members])
        slots = (np.asarray(seg.block_ids, dtype=np.int64)[:, None] * block_size + offsets).ravel()
        items.append(_Item(rows, slots, causal=False))
    decode = lens == 1
    for i in np.flatnonzero(~decode):  # several new tokens: the cached part whole, the new ones causally
        rows = np.arange(starts[i], starts[i] + lens[i])
        begin = int(covered[i]) * block_size
        if firsts[i] > begin:
            items.append(_Item(rows, _slots(tables[i], begin, int(firsts[i]), block_size), causal=False))
        items.append(
            _Item(rows, _slots(tables[i], int(firsts[i]), int(contexts[i]), block_size), causal=True)
        )
    decode_tiles = _decode_tiles(np.flatnonzero(decode), starts, contexts, covered, tables, block_size)
    tiles = _tile(items) + decode_tiles
    return AttentionPlan(tiles, tuple(segments), _merge_index(tiles, int(lens.sum())), len(decode_tiles))


def advance_decode(
    plan: AttentionPlan, context_lens: Sequence[int], tables: np.ndarray, block_size: int
) -> AttentionPlan | None:
    """The plan of the next decode step, from this one's, or None where only a fresh
    `plan_attention` can say. Precondition: every span of `plan` is one decode row
    (query row i of span i), each context one token longer now (`context_lens`), and
    `tables` the same block ids with a span's next block filled in where it needs one.

    Equal to `plan_attention(range(S), [1] * S, context_lens, tables, block_size,
    cascade)` for the `cascade` that made `plan`: a segment is a run of blocks held at
    the same depth by several rows before their queries, and a block that has just moved
    before a row's query holds its own latest tokens (written by it alone), so the
    segments stay the same unless that block's id also sits at the same depth of another
    row before its query (checked here: None). With the same segments, the segment tiles,
    which hold no decode row's own keys, stay as they are (and so do their partials'
    places); the private-context tiles are built again, longer by a key each. Why: a
    decode burst's steps re-planned 64 rows over a shared prefix in ~0.4 ms each, about
    5% of the step (`bench.peer`'s shared workload)."""
    contexts = np.asarray(context_lens, dtype=np.int64)
    num_spans = len(contexts)
    if (
        plan.num_decode_tiles == 0
        or sum(len(t.valid_rows) for t in plan.tiles[-plan.num_decode_tiles :]) != num_spans
    ):
        return None  # not every span was a decode row
    shareable = (contexts - 1) // block_size  # whole blocks before each row's query
    grown = np.flatnonzero(shareable > (contexts - 2) // block_size)
    if len(grown):
        depth = shareable[grown] - 1  # the block each grown row has just moved past
        moved = tables[grown, depth]
        for row, d, block in zip(grown.tolist(), depth.tolist(), moved.tolist()):
            others = (tables[:, d] == block) & (shareable > d)
            others[row] = False
            if others.any():
                return None  # a new shared block: a fresh plan finds its segment
    covered = _covered(plan.segments, num_spans)
    fixed = plan.tiles[: len(plan.tiles) - plan.num_decode_tiles]
    spans = np.arange(num_spans, dtype=np.int64)
    decode_tiles = _decode_tiles(spans, spans, contexts, covered, tables, block_size)
    tiles = fixed + decode_tiles
    old = plan.tiles[len(fixed) :]
    same_places = len(old) == len(decode_tiles) and all(
        np.array_equal(a.valid_rows, b.valid_rows) for a, b in zip(old, decode_tiles)
    )
    merge = plan.merge_index if same_places else _merge_index(tiles, num_spans)
    return AttentionPlan(tiles, plan.segments, merge, len(decode_tiles))


def _covered(segments: Sequence[Segment], num_spans: int) -> np.ndarray:
    """(S,) int64: the leading blocks of each span read through its segments."""
    covered = np.zeros(num_spans, dtype=np.int64)
    for seg in segments:
        members = np.asarray(seg.span_indices)
        covered[members] = np.maximum(covered[members], seg.first_block + seg.num_blocks)
    return covered


def _worth_cascading(
    segments: list[Segment], lens: np.ndarray, block_size: int, cascade: DecodeCascade
) -> list[Segment]:
    """The segments kept, parents first. A segment with a prefill member is kept (its
    rows run a fused kernel either way); a decode-only one needs what `cascade` says. A
    nested segment is kept only under a kept parent, so each row's kept segments stay one
    unbroken run from block 0 and its private context starts where they end."""
    kept: list[Segment] = []
    for seg in segments:  # sorted by first block: a parent comes before its children
        members = set(seg.span_indices)
        under_kept = seg.first_block == 0 or any(
            p.first_block + p.num_blocks == seg.first_block and members <= set(p.span_indices) for p in kept
        )
        decode_only = bool((lens[list(seg.span_indices)] == 1).all())
        reads = len(members) * seg.num_blocks * block_size
        worth = len(members) >= cascade.min_members and reads >= cascade.min_reads
        if under_kept and (not decode_only or worth):
            kept.append(seg)
    return kept


def _merge_index(tiles: tuple[TilePlan, ...], num_rows: int) -> np.ndarray | None:
    rows = np.concatenate([t.valid_rows for t in tiles])
    if len(rows) == num_rows:
        return None  # one partial per row
    # Where each real result sits among the tiles' whole results, concatenated.
    sizes = [t.query_rows.size for t in tiles]
    offsets = np.cumsum([0, *sizes[:-1]])
    places = np.concatenate([t.valid + offset for t, offset in zip(tiles, offsets)])
    order = np.argsort(rows, kind="stable")
    counts = np.bincount(rows, minlength=num_rows)
    rank = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)  # k-th partial of its row
    index = np.full((num_rows, int(counts.max())), sum(sizes), dtype=np.int64)
    index[rows[order], rank] = places[order]
    return index


def _decode_tiles(
    spans: np.ndarray,
    starts: np.ndarray,
    contexts: np.ndarray,
    covered: np.ndarray,
    tables: np.ndarray,
    block_size: int,
) -> tuple[TilePlan, ...]:
    """One new token per span sees its whole private context, itself included: one item
    per span, built for all of them at once (the common decode step)."""
    if len(spans) == 0:
        return ()
    key_lens = contexts[spans] - covered[spans] * block_size
    # One tile where padding at most doubles the slots (rows of like length, the usual
    # step): a tile is a kernel call, index gathers and a placement per layer, about 0.1 ms
    # a step on a recorded chat workload. Rows far apart split by powers of two instead.
    if 2 * int(key_lens.sum()) >= len(key_lens) * int(key_lens.max()):
        buckets = np.zeros_like(key_lens)
    else:
        buckets = _ceil_pow2_all(key_lens)
    tiles = []
    for bucket in np.unique(buckets):
        chosen = np.flatnonzero(buckets == bucket)
        members, lens = spans[chosen], key_lens[chosen]
        rows = starts[members]
        tiles.append(
            TilePlan(
                query_rows=rows[:, None],
                key_slots=_context_slots(tables[members], covered[members], lens, block_size),
                key_lens=lens,
                causal=False,
                valid=np.arange(len(members), dtype=np.int64),
                valid_rows=rows,
            )
        )
    return tuple(tiles)


def _context_slots(
    tables: np.ndarray, first_blocks: np.ndarray, lens: np.ndarray, block_size: int
) -> np.ndarray:
    """(I, max(lens)) int64: the pool slots of row i's keys from its block `first_blocks[i]`
    on; padding repeats the row's last real slot. Whole blocks are expanded at once, the
    rows sliced together where they start at the same block (a decode step's usual case:
    a recorded chat step's plan 0.41 -> 0.24 ms)."""
    width = int(lens.max())
    num_blocks = -(-width // block_size)
    if (first_blocks == first_blocks[0]).all():
        blocks = tables[:, first_blocks[0] : first_blocks[0] + num_blocks]
    else:
        columns = np.minimum(first_blocks[:, None] + np.arange(num_blocks), tables.shape[1] - 1)
        blocks = np.take_along_axis(tables, columns, axis=1)
    slots = (blocks[:, :, None] * block_size + np.arange(block_size)).reshape(len(lens), -1)[:, :width]
    if (lens < width).any():  # padding reads a real key of its row (never an unwritten slot)
        last = slots[np.arange(len(lens)), lens - 1]
        slots = np.where(np.arange(width)[None, :] < lens[:, None], slots, last[:, None])
    return np.ascontiguousarray(slots)


def _rows(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The flat rows start_i .. start_i + len_i - 1 of every span, concatenated."""
    return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)


def _slots(table: np.ndarray, begin: int, end: int, block_size: int) -> np.ndarray:
    positions = np.arange(begin, end, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


def _tile(items: list[_Item]) -> tuple[TilePlan, ...]:
    groups: dict[tuple[bool, int, int], list[_Item]] = {}
    for item in items:
        key = (item.causal, _ceil_pow2(len(item.rows)), _ceil_pow2(len(item.slots)))
        groups.setdefault(key, []).append(item)
    tiles = []
    for (causal, _, _), group in sorted(groups.items(), key=lambda kv: kv[0]):
        width_q = max(len(item.rows) for item in group)
        width_k = max(len(item.slots) for item in group)
        if causal:
            width_q = width_k = max(width_q, width_k)
        query_rows = np.empty((len(group), width_q), dtype=np.int64)
        key_slots = np.empty((len(group), width_k), dtype=np.int64)
        valid: list[np.ndarray] = []
        for i, item in enumerate(group):
            query_rows[i, : len(item.rows)] = item.rows
            query_rows[i, len(item.rows) :] = item.rows[0]
            key_slots[i, : len(item.slots)] = item.slots
            key_slots[i, len(item.slots) :] = item.slots[0]
            valid.append(i * width_q + np.arange(len(item.rows)))
        tiles.append(
            TilePlan(
                query_rows=query_rows,
                key_slots=key_slots,
                key_lens=np.array([len(item.slots) for item in group], dtype=np.int64),
                causal=causal,
                valid=np.concatenate(valid),
                valid_rows=np.concatenate([item.rows for item in group]),
            )
        )
    return tuple(tiles)


def _ceil_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _ceil_pow2_all(n: np.ndarray) -> np.ndarray:
    """`_ceil_pow2` of every entry (n >= 1): frexp's exponent of n - 1 is its bit length."""
    return np.left_shift(1, np.frexp(np.maximum(n - 1, 0).astype(np.float64))[1].astype(np.int64))
