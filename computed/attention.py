"""Paged attention over a flat batch of new tokens from several sequences.

One forward step carries T new tokens from S sequences, concatenated sequence after
sequence. Each sequence's earlier K/V lives in the KV pool in the blocks its block table
names; the step writes the new tokens' K/V into their slots, then every sequence attends
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

CPU choice, measured (torch 2.13, 1-2 threads, batches of 8 and 32 decode sequences, 32/8
heads, head_dim 128, contexts 100-2000 tokens): one SDPA call per sequence beat one padded,
masked SDPA call by 1.4-7x (the masked call leaves the fast kernel and pays for padding);
padding won only for toy models (14/2 heads x 64 and smaller, under 1 ms per layer either
way). So every sequence gets its own SDPA call, on CPU and on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from computed.kv_pool import KVPool

# Sequences that share leading cached blocks get cascade attention from this many on.
MIN_CASCADE_SEQUENCES = 2
# torch's fused CPU attention that also returns the log-sum-exp the cascade merge needs
# (6x faster than the einsum fallback on CPU); the einsum path serves other devices.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True)
class SpanInput:
    """One sequence's part of a step, in plain Python, as the engine knows it.

    Positions `[0, num_computed_tokens)` already have K/V in the pool; this step computes
    the `num_new_tokens` tokens at positions `num_computed_tokens ...`. `block_table`
    lists the sequence's block ids in order and must cover every position up to the last
    new one (extra trailing blocks are allowed and ignored). `write_kv` says which new
    tokens get their K/V written: True (all), False (none) or one bool per new token.
    A token that is not written must already have its K/V in the pool at its slot (a
    cached block), because attention reads the whole context back from the pool.
    """

    block_table: Sequence[int]
    num_computed_tokens: int
    num_new_tokens: int
    write_kv: bool | Sequence[bool] = True


@dataclass(frozen=True)
class SequenceSpan:
    """One sequence's slice of the flat batch, ready for the kernels.

    Invariant: the new tokens are the last `query_len` of the `context_len` visible ones,
    so new token i sits at position `context_len - query_len + i` and sees keys
    `0 .. context_len - query_len + i`.
    """

    query_start: int  # index of the first new token in the flat batch
    query_len: int
    context_len: int  # tokens visible after this step, new ones included
    block_table: torch.Tensor  # (ceil(context_len / block_size),) int64 block ids
    attn_mask: torch.Tensor | None  # (query_len, context_len) bool, True = may attend; see is_causal

    @property
    def is_causal(self) -> bool:
        """No cached prefix: a plain causal mask (SDPA's is_causal) is the right one."""
        return self.attn_mask is None and self.query_len > 1


@dataclass(frozen=True)
class SharedPrefix:
    """Sequences of one step whose block tables start with the same blocks.

    Cascade attention: all their query tokens attend to the shared blocks in ONE
    batched call (the prefix K/V is read from the pool once, not once per sequence),
    then each sequence's queries attend to its own suffix (causally), and the two
    halves are merged exactly through their log-sum-exp. Invariant: every shared token
    precedes every member's first query, so no mask is needed over the shared part,
    and each query sees at least itself in its suffix.
    """

    span_indices: tuple[int, ...]  # members, in batch order
    query_index: torch.Tensor  # (Q,) int64 flat indices of every member's query tokens, member by member
    block_table: torch.Tensor  # (num_blocks,) int64 the shared blocks
    num_blocks: int


@dataclass(frozen=True)
class AttentionBatch:
    """Everything one forward needs to know about where K/V lives. Build with `build`.

    Invariants: spans are in flat-batch order and tile [0, T) exactly; `write_slots` are
    distinct; `write_token_index` is ascending.
    """

    block_size: int
    positions: torch.Tensor  # (T,) int64 absolute position of each new token
    write_slots: torch.Tensor  # (W,) int64 pool slot = block_id * block_size + offset
    write_token_index: torch.Tensor  # (W,) int64 which of the T tokens goes to each slot
    spans: tuple[SequenceSpan, ...]
    last_token_index: torch.Tensor  # (S,) int64 flat index of each sequence's last new token
    max_position: int  # max(positions), known without a device sync
    # Groups of decode sequences sharing leading blocks (see SharedPrefix); may be empty.
    shared_prefixes: tuple[SharedPrefix, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_sequences(self) -> int:
        return len(self.spans)

    @classmethod
    def build(cls, spans: Sequence[SpanInput], block_size: int, device: torch.device | str) -> AttentionBatch:
        """Lay out `spans` one after another as one flat batch; raises ValueError on bad input."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not spans:
            raise ValueError("a batch needs at least one sequence")
        positions: list[int] = []
        slots: list[int] = []
        token_index: list[int] = []
        tables: list[int] = []
        layout: list[tuple[int, int, int, int, int]] = []  # query_start, len, context, table start, end
        for span in spans:
            _check_span(span, block_size)
            start, first = len(positions), span.num_computed_tokens
            context_len = first + span.num_new_tokens
            writes = span.write_kv
            if isinstance(writes, bool):
                writes = [writes] * span.num_new_tokens
            for i, position in enumerate(range(first, context_len)):
                if writes[i]:
                    block = span.block_table[position // block_size]
                    slots.append(block * block_size + position % block_size)
                    token_index.append(start + i)
            positions.extend(range(first, context_len))
            num_blocks = -(-context_len // block_size)
            layout.append((start, span.num_new_tokens, context_len, len(tables), len(tables) + num_blocks))
            tables.extend(span.block_table[:num_blocks])
        if len(set(slots)) != len(slots):
            raise ValueError("two new tokens of the batch write the same pool slot")

        device = torch.device(device)
        table_tensor = torch.tensor(tables, dtype=torch.long, device=device)
        sequence_spans = tuple(
            SequenceSpan(start, query_len, context_len, table_tensor[lo:hi],
                         _prefix_causal_mask(query_len, context_len, device))
            for start, query_len, context_len, lo, hi in layout)
        return cls(
            block_size=block_size,
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            write_slots=torch.tensor(slots, dtype=torch.long, device=device),
            write_token_index=torch.tensor(token_index, dtype=torch.long, device=device),
            spans=sequence_spans,
            last_token_index=torch.tensor([s + n - 1 for s, n, *_ in layout], dtype=torch.long, device=device),
            max_position=max(positions),
            shared_prefixes=_shared_prefixes(spans, layout, block_size, device),
        )


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, layer_idx: int,
                    batch: AttentionBatch, pool: KVPool, scale: float) -> torch.Tensor:
    """Write the new K/V into the pool, then attend each sequence over its context.

    q (T, H, D), k_new/v_new (T, Hkv, D) -> out (T, H, D). H must be a multiple of Hkv.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    assert num_tokens == batch.num_tokens, f"{num_tokens} tokens for a batch of {batch.num_tokens}"
    assert pool.block_size == batch.block_size, "batch built for another block size"
    key_cache, value_cache = pool.key(layer_idx), pool.value(layer_idx)  # (N, B, Hkv, D)
    _write(key_cache, value_cache, k_new, v_new, batch)

    out = torch.empty_like(q)
    in_cascade: set[int] = set()
    for group in batch.shared_prefixes:
        out[group.query_index] = _cascade(q, key_cache, value_cache, group, batch, scale)
        in_cascade.update(group.span_indices)
    for index, span in enumerate(batch.spans):
        if index in in_cascade:
            continue
        end = span.query_start + span.query_len
        # (nb, B, Hkv, D) -> (C, Hkv, D) -> (1, Hkv, C, D)
        k = key_cache[span.block_table].view(-1, num_kv_heads, head_dim)[: span.context_len]
        v = value_cache[span.block_table].view(-1, num_kv_heads, head_dim)[: span.context_len]
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        q_span = q[span.query_start:end].transpose(0, 1).unsqueeze(0)  # (1, H, Lq, D)
        o = F.scaled_dot_product_attention(q_span, k, v, attn_mask=span.attn_mask, is_causal=span.is_causal,
                                           scale=scale, enable_gqa=num_heads != num_kv_heads)
        out[span.query_start:end] = o[0].transpose(0, 1)  # (Lq, H, D)
    return out


def _cascade(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: SharedPrefix,
             batch: AttentionBatch, scale: float) -> torch.Tensor:
    """Attend to the shared blocks together, to each suffix alone, and merge the halves
    by their log-sum-exp (exact, up to float rounding). Returns (Q, H, D)."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    shared_len = group.num_blocks * batch.block_size
    queries = q[group.query_index]  # (Q, H, D)
    k = key_cache[group.block_table].view(-1, num_kv_heads, head_dim)  # (P, Hkv, D), read once
    v = value_cache[group.block_table].view(-1, num_kv_heads, head_dim)
    out, lse = _attend_with_lse(queries, k, v, scale)  # (Q, H, D), (Q, H)
    row = 0
    for index in group.span_indices:
        span = batch.spans[index]
        rows = slice(row, row + span.query_len)
        row += span.query_len
        suffix_len = span.context_len - shared_len
        table = span.block_table[group.num_blocks:]
        ks = key_cache[table].view(-1, num_kv_heads, head_dim)[:suffix_len]  # (L, Hkv, D)
        vs = value_cache[table].view(-1, num_kv_heads, head_dim)[:suffix_len]
        mask = None
        if span.query_len > 1:  # query i sits at suffix position L - query_len + i
            first = suffix_len - span.query_len
            mask = (torch.arange(suffix_len, device=q.device)[None, :]
                    <= torch.arange(first, suffix_len, device=q.device)[:, None])  # (Lq, L)
        o2, lse2 = _attend_with_lse(queries[rows], ks, vs, scale, mask)  # (Lq, H, D), (Lq, H)
        top = torch.maximum(lse[rows], lse2)  # (Lq, H)
        w1, w2 = (lse[rows] - top).exp()[..., None], (lse2 - top).exp()[..., None]
        out[rows] = (out[rows] * w1 + o2 * w2) / (w1 + w2)
    return out.to(q.dtype)


def _attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (S, H, D) over k/v (N, Hkv, D) in float32, grouped-query; `mask`
    (S, N) bool, True = may attend (each row must allow one key at least).
    Returns out (S, H, D) float32 and the log-sum-exp of the scores (S, H)."""
    num_queries, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if _FLASH_CPU is not None and q.device.type == "cpu" and q.dtype == torch.float32:
        group = num_heads // num_kv_heads
        # (N, Hkv, D) -> (1, H, N, D): the CPU flash kernel wants as many K/V heads as Q heads.
        kh = k.transpose(0, 1).repeat_interleave(group, dim=0)[None]
        vh = v.transpose(0, 1).repeat_interleave(group, dim=0)[None]
        additive = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
        out, lse = _FLASH_CPU(q.transpose(0, 1)[None], kh, vh, 0.0, False, attn_mask=additive, scale=scale)
        return out[0].transpose(0, 1), lse[0].transpose(0, 1)  # (S, H, D), (S, H)
    qg = q.float().view(num_queries, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (S, Hkv, g, D)
    scores = torch.einsum("skgd,nkd->skgn", qg, k.float()) * scale  # (S, Hkv, g, N)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    weights = (scores - top).exp()
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.einsum("skgn,nkd->skgd", weights, v.float()) / total  # (S, Hkv, g, D)
    lse = (top + total.log()).squeeze(-1)  # (S, Hkv, g)
    return out.reshape(num_queries, num_heads, head_dim), lse.reshape(num_queries, num_heads)


def _shared_prefixes(spans: Sequence[SpanInput], layout: list[tuple[int, int, int, int, int]], block_size: int,
                     device: torch.device) -> tuple[SharedPrefix, ...]:
    """Group spans that follow at least one cached block by their first block; keep groups
    of at least MIN_CASCADE_SEQUENCES, sharing the leading blocks that lie wholly before
    every member's first query."""
    by_first: dict[int, list[int]] = {}
    for index, span in enumerate(spans):
        if span.num_computed_tokens >= block_size:
            by_first.setdefault(span.block_table[0], []).append(index)
    groups = []
    for members in by_first.values():
        if len(members) < MIN_CASCADE_SEQUENCES:
            continue
        limit = min(spans[i].num_computed_tokens // block_size for i in members)
        first = spans[members[0]].block_table
        common = 0
        while common < limit and all(spans[i].block_table[common] == first[common] for i in members):
            common += 1
        rows = [t for i in members for t in range(layout[i][0], layout[i][0] + layout[i][1])]
        groups.append(SharedPrefix(
            span_indices=tuple(members),
            query_index=torch.tensor(rows, dtype=torch.long, device=device),
            block_table=torch.tensor(list(first[:common]), dtype=torch.long, device=device),
            num_blocks=common))
    return tuple(groups)


def _write(key_cache: torch.Tensor, value_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
           batch: AttentionBatch) -> None:
    num_writes = batch.write_slots.shape[0]
    if num_writes == 0:
        return
    if num_writes != batch.num_tokens:  # ascending token indices: W == T means all, in order
        k_new = k_new.index_select(0, batch.write_token_index)
        v_new = v_new.index_select(0, batch.write_token_index)
    _, _, num_kv_heads, head_dim = key_cache.shape
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.write_slots, k_new.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.write_slots, v_new.to(value_cache.dtype))


def _prefix_causal_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor | None:
    """(Lq, C) bool mask for queries that follow a cached prefix; None when not needed."""
    if query_len == 1 or query_len == context_len:
        return None  # one query sees everything / no prefix: is_causal does it
    first = context_len - query_len
    query_pos = torch.arange(first, context_len, device=device)[:, None]
    return torch.arange(context_len, device=device)[None, :] <= query_pos


def _check_span(span: SpanInput, block_size: int) -> None:
    if span.num_new_tokens <= 0:
        raise ValueError(f"a span needs at least one new token, got {span.num_new_tokens}")
    if span.num_computed_tokens < 0:
        raise ValueError(f"num_computed_tokens must be >= 0, got {span.num_computed_tokens}")
    context_len = span.num_computed_tokens + span.num_new_tokens
    if len(span.block_table) * block_size < context_len:
        raise ValueError(
            f"block table of {len(span.block_table)} blocks of {block_size} cannot hold {context_len} tokens")
    if any(block < 0 for block in span.block_table):
        raise ValueError(f"negative block id in {list(span.block_table)}")
    if not isinstance(span.write_kv, bool) and len(span.write_kv) != span.num_new_tokens:
        raise ValueError(f"write_kv has {len(span.write_kv)} flags for {span.num_new_tokens} new tokens")
