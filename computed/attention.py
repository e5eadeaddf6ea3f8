"""Paged attention over a flat batch of new tokens from several sequences.

One forward step carries T new tokens from S sequences, concatenated sequence after
sequence. Each sequence's earlier K/V lives in the KV pool in the blocks its block table
names; the step writes the new tokens' K/V into their slots, then every query attends
over its whole context read back from the pool.

Building a batch (the engine's side), e.g. a prompt of 10 tokens whose first 8 are
cached in blocks [7, 3] (block_size 4), plus a sequence decoding its 6th token:

    batch = AttentionBatch.build([
        SpanInput(block_table=[7, 3, 12], num_computed_tokens=8, num_new_tokens=2),
        SpanInput(block_table=[5, 9], num_computed_tokens=5, num_new_tokens=1),
    ], block_size=4, device=device)
    hidden = model(input_ids, batch, pool)          # input_ids: the 3 new tokens, in span order
    logits = model.compute_logits(hidden[batch.last_token_index])   # (S, vocab)

A fully cached prompt of 8 tokens still needs the logits of its last token; it recomputes
position 7 without writing into the shared block:
    SpanInput(block_table=[7, 3], num_computed_tokens=7, num_new_tokens=1, write_kv=False)

Plan once per step, run per layer: `build` lays out the slots and asks
`computed.attention_plan` for the tiles (cascade segments shared by several sequences,
each sequence's private context, causal new tokens); `paged_attention` runs each tile
as a few tensor calls, so the number of kernel calls per layer does not grow with the
number of sequences, and merges the partials of each query by their log-sum-exp.

CPU kernels, measured (`python -m bench.attention_kernels`, torch 2.13, 2 threads, 8/4
heads x 32). A tile of one query per item (every decode row's private context) runs
`computed.kernels`' paged decode kernel where it builds: it reads each key and value
once, straight from the pool through the slot list, where gathering them for a fused
kernel read them twice and wrote them once (memory-bound on CPU); 4 layers of 8 rows x
1,001 keys 11.3 -> 4.8 ms, 64 x 97 8.8 -> 3.8 ms, 64 x 1,100 89 -> 37 ms (cold caches).
Tiles of several queries per item (prefill chunks, shared segments) run its paged flash
kernel: K/V read once per item and K/V head through the slot list, the query heads of
one K/V head folded into its rows; against torch's fused CPU flash kernel on gathered,
head-repeated K/V (`python -m bench.attention_kernels`, flash block): causal 4 x 1,088
81 -> 51 ms, 64 decode rows x 1,024 shared keys 2.2 -> 1.6 ms, 16 items x 64 rows x
1,024 keys 33 -> 27 ms. Where it does not build, torch's flash kernel runs those tiles
(it beat a batched matmul by 1.6-2.4x and one SDPA call per sequence by 2x). On CUDA
every tile runs `computed.triton_attention`'s kernel, which has the native flash op's
contract (`python -m bench.gpu_attention`, H100, one layer of Qwen3-0.6B's heads in
bfloat16: 256 decode rows x 1,024 keys 9.9-10.2 -> 0.51-0.62 ms against the matmul
path). Other devices and dtypes, and CUDA without Triton, use the float32 matmul path.

Which of these runs is one `computed.backends` backend (cpu_native, cuda_triton,
torch_portable), chosen once when the model loads and handed to `paged_attention`,
`write_new_kv` and `attend`; this module only lays out the step and places or merges the
tiles' partials. A call that names no backend asks the registry for its tensors.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from computed import kernels
from computed.attention_plan import (
    EVERY_SEGMENT,
    AttentionPlan,
    DecodeCascade,
    Segment,
    TilePlan,
    advance_decode,
    plan_attention,
)
from computed.backends import AttentionBackend
from computed.backends.registry import (
    CPU_FLASH,
    NATIVE_POOL_DTYPES,
    AttentionTarget,
    select_attention_backend,
)
from computed.backends.torch_portable import attend_tile_matmul, merge_dense
from computed.kv_pool import KVPool

# torch's fused CPU attention that also returns the log-sum-exp the merge needs (None keeps
# a call that names no backend to matmuls off the native kernels: tests set it so).
_FLASH_CPU = CPU_FLASH


class SpanInput(NamedTuple):
    """One sequence's part of a step, in plain Python, as the engine knows it.

    Positions `[0, num_computed_tokens)` already have K/V in the pool; this step computes
    the `num_new_tokens` tokens at positions `num_computed_tokens ...`. `block_table`
    lists the sequence's block ids in order and must cover every position up to the last
    new one (extra trailing blocks are allowed and ignored). `write_kv` says which new
    tokens get their K/V written: True (all), False (none) or one bool per new token.
    A token that is not written must already have its K/V in the pool at its slot (a
    cached block), because attention reads the whole context back from the pool.
    (Immutable, as a tuple: a step makes one per sequence, a frozen dataclass cost 2 us.)
    """

    block_table: Sequence[int]
    num_computed_tokens: int
    num_new_tokens: int
    write_kv: bool | Sequence[bool] = True


@dataclass(frozen=True)
class SequenceSpan:
    """One sequence's slice of the flat batch.

    Invariant: the new tokens are the last `query_len` of the `context_len` visible ones,
    so new token i sits at position `context_len - query_len + i` and sees keys
    `0 .. context_len - query_len + i`.
    """

    query_start: int  # index of the first new token in the flat batch
    query_len: int
    context_len: int  # tokens visible after this step, new ones included
    block_table: np.ndarray  # (ceil(context_len / block_size),) int64 block ids (host)


@dataclass(frozen=True)
class Tile:
    """A TilePlan's index tensors on the device (built once per step, read by every layer)."""

    query_rows: torch.Tensor  # (I, Qm) int64
    key_slots: torch.Tensor  # (I * Lm,) int64, item-major
    key_lens: torch.Tensor  # (I,) int64 real keys per item
    causal: bool
    valid: torch.Tensor  # (P,) int64 into the flattened (I * Qm) results
    valid_rows: torch.Tensor  # (P,) int64 flat query rows
    num_items: int
    num_queries: int  # Qm
    num_keys: int  # Lm
    host_key_lens: np.ndarray  # key_lens on the host
    # The padded query rows are all the step's rows, 0 .. T - 1 in order, none padding: the
    # tile reads q as it is and its results are the rows' own (no gather, no placement).
    in_order: bool = False

    @functools.cached_property
    def key_bias(self) -> torch.Tensor | None:
        """(I, 1, 1, Lm) float32: 0 for a real key, -inf for padding; None where no item
        has padding keys (causal tiles never do). Built on first use, once per step: only
        torch's kernels read it (the native ones take `key_lens`)."""
        if self.causal or bool((self.host_key_lens >= self.num_keys).all()):
            return None
        padding = np.arange(self.num_keys)[None, :] >= self.host_key_lens[:, None]  # (I, Lm)
        return (
            torch.zeros(self.num_items, 1, 1, self.num_keys)
            .masked_fill_(torch.from_numpy(padding)[:, None, None, :], float("-inf"))
            .to(self.key_lens.device)
        )

    @classmethod
    def from_plan(cls, plan: TilePlan, device: torch.device, num_tokens: int) -> Tile:
        num_items, width_q = plan.query_rows.shape
        size = plan.query_rows.size
        in_order = size == num_tokens == len(plan.valid_rows) and bool(
            (plan.query_rows.reshape(-1) == np.arange(size)).all()
        )
        return cls(
            query_rows=torch.from_numpy(plan.query_rows).to(device),
            key_slots=torch.from_numpy(plan.key_slots.reshape(-1)).to(device),
            key_lens=torch.from_numpy(plan.key_lens).to(device),
            causal=plan.causal,
            valid=torch.from_numpy(plan.valid).to(device),
            valid_rows=torch.from_numpy(plan.valid_rows).to(device),
            num_items=num_items,
            num_queries=width_q,
            num_keys=plan.key_slots.shape[1],
            host_key_lens=plan.key_lens,
            in_order=in_order,
        )


@dataclass(frozen=True)
class AttentionBatch:
    """Everything one forward needs to know about where K/V lives. Build with `build`.

    Invariants: spans are in flat-batch order and tile [0, T) exactly; `write_slots` are
    distinct and `write_token_index` ascending (but in a static decode batch, whose padding
    rows repeat row 0's slot and row: the same bytes to the same place); every query row is
    covered by the tiles' partials, which together read exactly its context once.
    """

    block_size: int
    positions: torch.Tensor  # (T,) int64 absolute position of each new token
    write_slots: torch.Tensor  # (W,) int64 pool slot = block_id * block_size + offset
    write_token_index: torch.Tensor  # (W,) int64 which of the T tokens goes to each slot
    # The spans on the host: (S,) int64 first flat row, new tokens, context (new included);
    # (S, N) int64 block tables, row i's first ceil(context_i / block_size) blocks real.
    query_starts: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    tables: np.ndarray
    last_token_index: torch.Tensor  # (S,) int64 flat index of each sequence's last new token
    max_position: int  # max(positions), known without a device sync
    tiles: tuple[Tile, ...] = ()
    # Runs of blocks shared by several sequences, read once per step (cascade); may be empty.
    shared_prefixes: tuple[Segment, ...] = ()
    # (T, depth) int64 partials of each query row, R = none (see AttentionPlan.merge_index).
    merge_index: torch.Tensor | None = None
    plan: AttentionPlan | None = None  # what the tiles were made from (host arrays)
    # True: `write_token_index` picks the written rows even where W == T (a static decode
    # batch's padding rows write row 0's K/V again, `computed.decode_graphs`); False: W == T
    # means every token, in order.
    write_rows_selected: bool = False

    @functools.cached_property
    def native_tiles(self) -> tuple[list[torch.Tensor], list[bool], list[bool]]:
        """The tiles as `kvcache::forward_layers` takes them: each tile's query_rows, key_slots
        (I, Lm), key_lens, valid and valid_rows concatenated, then causal and in_order per
        tile (built on first use, once per step)."""
        flat = [
            t
            for tile in self.tiles
            for t in (
                tile.query_rows,
                tile.key_slots.view(tile.num_items, tile.num_keys),
                tile.key_lens,
                tile.valid,
                tile.valid_rows,
            )
        ]
        return flat, [tile.causal for tile in self.tiles], [tile.in_order for tile in self.tiles]

    @property
    def needs_merge(self) -> bool:
        return self.merge_index is not None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_sequences(self) -> int:
        return len(self.query_lens)

    @functools.cached_property
    def spans(self) -> tuple[SequenceSpan, ...]:
        """Each sequence's slice of the flat batch, in order (built on first use: the
        step's kernels read the arrays)."""
        num_blocks = -(-self.context_lens // self.block_size)
        return tuple(
            SequenceSpan(start, length, context, self.tables[i, :blocks])
            for i, (start, length, context, blocks) in enumerate(
                zip(
                    self.query_starts.tolist(),
                    self.query_lens.tolist(),
                    self.context_lens.tolist(),
                    num_blocks.tolist(),
                )
            )
        )

    @classmethod
    def build(
        cls,
        spans: Sequence[SpanInput],
        block_size: int,
        device: torch.device | str,
        cascade: DecodeCascade = EVERY_SEGMENT,
    ) -> AttentionBatch:
        """Lay out `spans` one after another as one flat batch; raises ValueError on bad input.
        `cascade`: see `plan_attention` and `decode_cascade`."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not spans:
            raise ValueError("a batch needs at least one sequence")
        device = torch.device(device)
        lens = np.array([s.num_new_tokens for s in spans], dtype=np.int64)
        firsts = np.array([s.num_computed_tokens for s in spans], dtype=np.int64)
        contexts = firsts + lens
        num_blocks = -(-contexts // block_size)
        table_lens = np.array([len(s.block_table) for s in spans], dtype=np.int64)
        if (lens <= 0).any() or (firsts < 0).any() or (table_lens < num_blocks).any():
            for span in spans:
                _check_span(span, block_size)  # says which span, and what is wrong with it
        starts = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
        # One fill of the padded tables from every span's whole table, in row order (a
        # Python loop of row assignments cost 0.2 ms for 64 spans); blocks past a row's
        # context are then dropped.
        listed = np.fromiter(
            itertools.chain.from_iterable(s.block_table for s in spans),
            dtype=np.int64,
            count=int(table_lens.sum()),
        )
        if len(listed) and listed.min() < 0:
            raise ValueError(f"negative block id in {listed[listed < 0][:8].tolist()}")
        columns = np.arange(int(num_blocks.max()))[None, :]
        tables = np.zeros((len(spans), columns.shape[1]), dtype=np.int64)
        starts_in_listed = np.cumsum(table_lens) - table_lens
        inside = columns < num_blocks[:, None]
        tables[inside] = listed[(starts_in_listed[:, None] + columns)[inside]]
        span_of_token = np.repeat(np.arange(len(spans)), lens)  # (T,)
        positions = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(starts - firsts, lens)
        slots = tables[span_of_token, positions // block_size] * block_size + positions % block_size
        writes = np.ones(len(positions), dtype=bool)
        for i, span in enumerate(spans):
            if span.write_kv is not True:
                if not isinstance(span.write_kv, bool) and len(span.write_kv) != span.num_new_tokens:
                    _check_span(span, block_size)
                writes[starts[i] : starts[i] + lens[i]] = span.write_kv
        write_index = np.flatnonzero(writes)
        write_slots = slots[write_index]
        if len(np.unique(write_slots)) != len(write_slots):
            raise ValueError("two new tokens of the batch write the same pool slot")

        plan: AttentionPlan = plan_attention(starts, lens, contexts, tables, block_size, cascade)
        tiles = tuple(Tile.from_plan(t, device, len(positions)) for t in plan.tiles)
        return cls(
            block_size=block_size,
            positions=torch.from_numpy(positions).to(device),
            write_slots=torch.from_numpy(write_slots).to(device),
            write_token_index=torch.from_numpy(write_index.astype(np.int64)).to(device),
            query_starts=starts,
            query_lens=lens,
            context_lens=contexts,
            tables=tables,
            last_token_index=torch.from_numpy(starts + lens - 1).to(device),
            max_position=int(contexts.max()) - 1,
            tiles=tiles,
            shared_prefixes=plan.segments,
            merge_index=None if plan.merge_index is None else torch.from_numpy(plan.merge_index).to(device),
            plan=plan,
        )

    def next_decode(
        self, spans: Sequence[SpanInput], cascade: DecodeCascade = EVERY_SEGMENT
    ) -> AttentionBatch:
        """The batch `build(spans, ...)` makes, where `spans` are this batch's decode rows
        one token further (the next step of a decode burst: the same sequences in the same
        order, each `num_computed_tokens` one more, one new token written, the same block
        table with room for it). Reuses what does not change: the block tables but for a
        newly entered block, the segments and their tiles (`attention_plan.advance_decode`);
        anything else builds afresh. `cascade` must be the one this batch
        was built with. Why: a fresh build cost ~0.4 ms of a 64-row step over a shared
        prefix (about 5%); this one ~0.1 ms."""
        device = self.positions.device
        contexts = self.context_lens + 1
        continues = (
            self.plan is not None
            and len(spans) == len(self.context_lens) == len(self.write_token_index)
            and (self.query_lens == 1).all()
            and all(
                s.num_new_tokens == 1 and s.write_kv is True and s.num_computed_tokens == c - 1
                for s, c in zip(spans, contexts.tolist())
            )
        )
        if not continues:
            return AttentionBatch.build(spans, self.block_size, device, cascade)
        bs = self.block_size
        positions = contexts - 1
        rows = np.arange(len(spans))
        entering = np.flatnonzero(positions % bs == 0)  # rows whose new token opens a block
        tables = self.tables
        if len(entering):
            needed = int((positions[entering] // bs).max()) + 1
            tables = np.zeros((len(spans), max(needed, tables.shape[1])), dtype=np.int64)
            tables[:, : self.tables.shape[1]] = self.tables
            for i in entering.tolist():
                table, block = spans[i].block_table, int(positions[i]) // bs
                if len(table) <= block or table[block] < 0:
                    _check_span(spans[i], bs)  # says what is wrong with it
                tables[i, block] = table[block]
        write_slots = tables[rows, positions // bs] * bs + positions % bs
        if len(entering) and len(np.unique(write_slots)) != len(write_slots):
            raise ValueError("two new tokens of the batch write the same pool slot")
        plan = advance_decode(self.plan, contexts, tables, bs)
        if plan is None:
            return AttentionBatch.build(spans, bs, device, cascade)
        fixed = len(plan.tiles) - plan.num_decode_tiles
        tiles = self.tiles[:fixed] + tuple(Tile.from_plan(t, device, len(spans)) for t in plan.tiles[fixed:])
        merge_index = self.merge_index
        if plan.merge_index is not self.plan.merge_index:
            merge_index = None if plan.merge_index is None else torch.from_numpy(plan.merge_index).to(device)
        return AttentionBatch(
            block_size=bs,
            positions=torch.from_numpy(positions).to(device),
            write_slots=torch.from_numpy(write_slots).to(device),
            write_token_index=self.write_token_index,
            query_starts=self.query_starts,
            query_lens=self.query_lens,
            context_lens=contexts,
            tables=tables,
            last_token_index=self.last_token_index,
            max_position=int(contexts.max()) - 1,
            tiles=tiles,
            shared_prefixes=plan.segments,
            merge_index=merge_index,
            plan=plan,
        )


# When a shared segment of decode rows only is cascaded where the native decode kernel runs,
# by how many keys at a time the flash kernel copies K/V out of the pool
# (`kernels.flash_gather_keys`); below the rule, each row reading the segment from cache in
# its own item beats the segment's flash item and merge. `python -m bench.attention_kernels`,
# cascade block, 4 layers, cascaded vs flat (ms).
# 16 keys at a time (AVX-512), a bfloat16 pool on a 2-core Zen 5: 4 groups of 8 rows x 1,024
# shared keys 0.88 vs 1.41, 8 x 3 x 1,024 0.91 vs 1.07, 4 x 6 x 512 0.46 vs 0.61; two members
# lose at every length (16 x 2 x 1,024: 1.74 vs 1.46, float32 3.11 vs 2.85); at 2,048 reads
# about even (8 x 4 x 512 0.70 vs 0.77, float32 0.95 vs 0.92), at 1,024 even (8 x 4 x 256:
# 0.47 vs 0.49).
WIDE_GATHER_CASCADE = DecodeCascade(min_members=3, min_reads=3 * 1024)
# 8 keys at a time (AVX2, whose flash tiles take 6 rows), 2-core Zen 3, interleaved, medians
# of 25, cascaded / flat, float32 and bfloat16 pools: members count, not reads (8,192 reads
# each): 2 x 16 x 512 0.76 and 0.68, 4 x 8 x 1,024 0.81 and 0.77, 4 x 4 x 2,048 1.22 and
# 1.14, 4 x 2 x 4,096 2.02 and 1.74; 4 x 6 x 1,024 0.96 and 0.78, 8 x 4 x 1,024 1.31 and
# 1.07, 8 x 3 x 1,024 1.29 and 1.10.
NARROW_GATHER_CASCADE = DecodeCascade(min_members=6, min_reads=3 * 1024)
# A key at a time (a head size the register copies do not take, a machine without AVX2):
# the rule measured before the wide copies (3 or 4 members lost: the same block, 8-lane
# build, float32: 8 x 3 x 1,024 2.06 vs 1.75 ms, 8 x 4 x 1,024 2.47 vs 2.35).
KEY_GATHER_CASCADE = DecodeCascade(min_members=3, min_reads=16 * 1024)


def decode_cascade(device: torch.device, dtype: torch.dtype, head_dim: int) -> DecodeCascade:
    """What to pass `AttentionBatch.build` for a model running in `dtype` on `device`, with
    K/V heads of `head_dim`: off the native decode kernel, every segment."""
    native = device.type == "cpu" and dtype in NATIVE_POOL_DTYPES and kernels.paged_decode() is not None
    gather_keys = kernels.flash_gather_keys()
    if not native or gather_keys is None:
        return EVERY_SEGMENT
    keys = gather_keys(head_dim, dtype == torch.bfloat16)
    return WIDE_GATHER_CASCADE if keys >= 16 else NARROW_GATHER_CASCADE if keys >= 8 else KEY_GATHER_CASCADE


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    layer_idx: int,
    batch: AttentionBatch,
    pool: KVPool,
    scale: float,
    backend: AttentionBackend | None = None,
) -> torch.Tensor:
    """Write the new K/V into the pool, then attend every query over its context.

    q (T, H, D), k_new/v_new (T, Hkv, D) -> out (T, H, D). H must be a multiple of Hkv.
    `backend`: the one the model was given at load (`computed.backends`); None asks the
    registry for this call's tensors.
    """
    write_new_kv(k_new, v_new, layer_idx, batch, pool, backend)
    return attend(q, layer_idx, batch, pool, scale, backend)


def write_new_kv(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    layer_idx: int,
    batch: AttentionBatch,
    pool: KVPool,
    backend: AttentionBackend | None = None,
) -> None:
    """Write the new tokens' K/V (T, Hkv, D) into their pool slots (those `batch` writes)."""
    assert k_new.shape[0] == batch.num_tokens, f"{k_new.shape[0]} tokens for a batch of {batch.num_tokens}"
    assert pool.block_size == batch.block_size, "batch built for another block size"
    num_writes = batch.write_slots.shape[0]
    if num_writes == 0:
        return
    if num_writes != batch.num_tokens or batch.write_rows_selected:  # else all, in order
        k_new = k_new.index_select(0, batch.write_token_index)
        v_new = v_new.index_select(0, batch.write_token_index)
    key_cache, value_cache = pool.key(layer_idx), pool.value(layer_idx)  # (N, B, Hkv, D)
    _, _, num_kv_heads, head_dim = key_cache.shape
    if backend is None:
        backend = backend_for(k_new, key_cache, k_new.shape[1])
    backend.write(
        key_cache.view(-1, num_kv_heads, head_dim),
        value_cache.view(-1, num_kv_heads, head_dim),
        k_new,
        v_new,
        batch.write_slots,
    )


def attend(
    q: torch.Tensor,
    layer_idx: int,
    batch: AttentionBatch,
    pool: KVPool,
    scale: float,
    backend: AttentionBackend | None = None,
) -> torch.Tensor:
    """Every query (T, H, D) over its context as the pool holds it now -> out (T, H, D)."""
    num_tokens, num_heads, head_dim = q.shape
    key_cache, value_cache = pool.key(layer_idx), pool.value(layer_idx)  # (N, B, Hkv, D)
    num_kv_heads = key_cache.shape[2]
    assert num_tokens == batch.num_tokens, f"{num_tokens} tokens for a batch of {batch.num_tokens}"
    assert pool.block_size == batch.block_size, "batch built for another block size"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads for {num_kv_heads} K/V heads"
    if backend is None:
        backend = backend_for(q, key_cache, num_heads)
    keys = key_cache.view(-1, num_kv_heads, head_dim)  # (N * B, Hkv, D): one row per slot
    values = value_cache.view(-1, num_kv_heads, head_dim)

    results = [backend.attend_tile(q, keys, values, tile, scale) for tile in batch.tiles]
    if len(results) == 1 and batch.tiles[0].in_order:  # every row once, in order: a plain decode step
        return results[0][0].to(q.dtype)
    if not batch.needs_merge:  # one partial per query row: place them
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        for tile, (o, _) in zip(batch.tiles, results):
            out.index_copy_(0, tile.valid_rows, o.index_select(0, tile.valid))
        return out.to(q.dtype)
    outs = [o.contiguous() for o, _ in results]  # (I*Qm, H, D) each, float32
    lses = [lse.contiguous() for _, lse in results]  # (I*Qm, H)
    return backend.merge(outs, lses, batch.merge_index).to(q.dtype)


def backend_for(x: torch.Tensor, key_cache: torch.Tensor, num_heads: int) -> AttentionBackend:
    """The registry's backend for a call that was given none: queries or new K/V `x` of
    `num_heads` heads against the pool layer `key_cache` (N, B, Hkv, D). Asked afresh each
    call (a model asks once, at load: `CausalLM.use_attention_backend`)."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    target = AttentionTarget(x.device, x.dtype, key_cache.dtype, head_dim, num_heads // num_kv_heads)
    return select_attention_backend(target, _FLASH_CPU).backend


# Kept under their old names for callers of the torch path (tests, benchmarks).
_merge = merge_dense
_attend_tile_matmul = attend_tile_matmul


def _check_span(span: SpanInput, block_size: int) -> None:
    if span.num_new_tokens <= 0:
        raise ValueError(f"a span needs at least one new token, got {span.num_new_tokens}")
    if span.num_computed_tokens < 0:
        raise ValueError(f"num_computed_tokens must be >= 0, got {span.num_computed_tokens}")
    context_len = span.num_computed_tokens + span.num_new_tokens
    if len(span.block_table) * block_size < context_len:
        raise ValueError(
            f"block table of {len(span.block_table)} blocks of {block_size} cannot hold {context_len} tokens"
        )
    if len(span.block_table) and min(span.block_table) < 0:
        raise ValueError(f"negative block id in {list(span.block_table)}")
    if not isinstance(span.write_kv, bool) and len(span.write_kv) != span.num_new_tokens:
        raise ValueError(f"write_kv has {len(span.write_kv)} flags for {span.num_new_tokens} new tokens")
