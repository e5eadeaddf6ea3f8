"""The batched paged attention against dense attention, and the plan's shape guarantees.

Random steps mix decode rows and prefill chunks over block tables that share nested
prefixes (the same physical blocks at the same depth), so every tile kind, key padding
and the log-sum-exp merge are exercised; both the fused CPU kernel and the matmul path.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from computed import attention, kernels
from computed.attention import AttentionBatch, SpanInput, paged_attention
from computed.attention_plan import EVERY_SEGMENT, DecodeCascade, find_segments, plan_attention
from computed.kv_pool import KVPool

CPU = torch.device("cpu")


def _random_step(rng: random.Random, block: int, num_spans: int):
    """Block tables from a random trie of shared runs; returns spans and each span's
    dense K/V (context) with the shared blocks' K/V identical across sharers."""
    free = list(range(1, 400))
    rng.shuffle(free)
    trunks = [[free.pop() for _ in range(rng.randint(1, 4))] for _ in range(2)]
    branches = [trunk + [free.pop() for _ in range(rng.randint(0, 3))] for trunk in trunks for _ in range(2)]
    spans, tables, cached, lengths = [], [], [], []
    for _ in range(num_spans):
        base = list(rng.choice(branches + [[]]))
        new = 1 if rng.random() < 0.6 else rng.randint(2, 3 * block)
        extra = rng.randint(0, 2 * block)  # private cached tokens after the shared blocks
        done = len(base) * block + extra
        total = done + new
        table = base + [free.pop() for _ in range(-(-total // block) - len(base))]
        tables.append(table)
        cached.append(done)
        lengths.append(total)
        spans.append(SpanInput(table, done, new))
    return spans, tables, cached, lengths


def _fill(pool: KVPool, tables, cached, kv_heads: int, dim: int, gen: torch.Generator):
    """Random K/V per physical block slot (shared blocks hence agree), read back densely."""
    block = pool.block_size
    slot_k = torch.randn(pool.num_blocks * block, kv_heads, dim, generator=gen)
    slot_v = torch.randn(pool.num_blocks * block, kv_heads, dim, generator=gen)
    pool.key(0).view(-1, kv_heads, dim).copy_(slot_k)
    pool.value(0).view(-1, kv_heads, dim).copy_(slot_v)
    keys, values = [], []
    for table, done in zip(tables, cached):
        slots = torch.tensor([table[p // block] * block + p % block for p in range(done)], dtype=torch.long)
        keys.append(slot_k[slots])
        values.append(slot_v[slots])
    return keys, values


def _dense(q, keys, values, heads: int, kv_heads: int, dim: int, cached, lengths):
    out, start = [], 0
    for k, v, c, n in zip(keys, values, cached, lengths):
        qs = q[start : start + n - c].transpose(0, 1)  # (H, Lq, D)
        kk = k.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # (H, n, D)
        vv = v.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        scores = qs @ kk.transpose(1, 2) * dim**-0.5
        visible = torch.arange(n)[None, :] <= torch.arange(c, n)[:, None]
        out.append((scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vv).transpose(0, 1))
        start += n - c
    return torch.cat(out)


@pytest.mark.parametrize("cascade", [EVERY_SEGMENT, DecodeCascade(3, 40)])
@pytest.mark.parametrize("path", ["native", "fused-cpu", "matmul"])
@pytest.mark.parametrize("seed", range(12))
def test_random_steps_match_dense_attention(
    seed: int, path: str, cascade: DecodeCascade, monkeypatch
) -> None:
    if path == "native":
        if not kernels.has_compiler():
            pytest.skip("needs a C++ compiler to build the native kernel")
        assert kernels.paged_decode() is not None, (
            f"the native decode kernel did not build: {kernels.error()}"
        )
    else:  # torch's kernels only: no native attention op
        monkeypatch.setattr(kernels, "paged_decode", lambda: None)
        monkeypatch.setattr(kernels, "paged_flash", lambda: None)
        monkeypatch.setattr(kernels, "merge_partials", lambda: None)
    if path == "matmul":
        monkeypatch.setattr(attention, "_FLASH_CPU", None)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, block = rng.choice([(4, 2, 8), (6, 3, 16), (4, 4, 8), (8, 1, 8)]) + (
        rng.choice([4, 16]),
    )
    spans, tables, cached, lengths = _random_step(rng, block, rng.randint(1, 12))
    pool = KVPool(1, 400, block, kv_heads, dim, torch.float32, CPU)
    keys, values = _fill(pool, tables, cached, kv_heads, dim, gen)
    batch = AttentionBatch.build(spans, block, CPU, cascade)
    k_new = torch.randn(batch.num_tokens, kv_heads, dim, generator=gen)
    v_new = torch.randn(batch.num_tokens, kv_heads, dim, generator=gen)
    q = torch.randn(batch.num_tokens, heads, dim, generator=gen)
    start = 0
    for i, (c, n) in enumerate(zip(cached, lengths)):  # the dense context includes the new tokens
        keys[i] = torch.cat([keys[i], k_new[start : start + n - c]])
        values[i] = torch.cat([values[i], v_new[start : start + n - c]])
        start += n - c
    out = paged_attention(q, k_new, v_new, 0, batch, pool, scale=dim**-0.5)
    torch.testing.assert_close(
        out, _dense(q, keys, values, heads, kv_heads, dim, cached, lengths), atol=2e-5, rtol=1e-4
    )


def test_nested_prefixes_become_nested_segments() -> None:
    # a, b, c share [1, 2]; a and b also share [3]; d shares nothing.
    tables = np.array([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 0], [7, 8, 9, 0]])
    segments = find_segments(tables, np.array([4, 4, 3, 3]))
    assert [(s.span_indices, s.first_block, s.block_ids) for s in segments] == [
        ((0, 1, 2), 0, (1, 2)),
        ((0, 1), 2, (3,)),
    ]


def _decode_spans(tables: list[list[int]], block: int) -> list[SpanInput]:
    return [SpanInput(t, len(t) * block - 1, 1) for t in tables]


def test_small_decode_only_segments_are_read_flat() -> None:
    """Below the threshold a decode-only segment is no item of its own: each row's private
    context starts at block 0 (fewer tiles); at or above it the segment stays."""
    tables = [[1, 2, 10 + i] for i in range(3)]  # 3 rows x 2 shared blocks of 4 = 24 reads
    flat = AttentionBatch.build(_decode_spans(tables, 4), 4, CPU, DecodeCascade(3, 25))
    assert flat.shared_prefixes == ()
    assert [t.num_keys for t in flat.tiles] == [12]
    kept = AttentionBatch.build(_decode_spans(tables, 4), 4, CPU, DecodeCascade(3, 24))
    assert [g.span_indices for g in kept.shared_prefixes] == [(0, 1, 2)]


def test_a_decode_only_segment_needs_its_members() -> None:
    """A decode-only segment under a cascade rule needs its members, however long it is
    (two rows re-reading it cost less than its item and merge under the wide copy's rule,
    five under the 8-key copy's); with no rule two members do."""
    shared = list(range(1, 129))  # 128 blocks of 4: 512 keys, 6 x 512 = 3K reads

    def rows(n: int) -> list[SpanInput]:
        return _decode_spans([[*shared, 1000 + i] for i in range(n)], 4)

    wide, narrow = attention.WIDE_GATHER_CASCADE, attention.NARROW_GATHER_CASCADE
    assert (wide.min_members, narrow.min_members) == (3, 6)
    assert AttentionBatch.build(rows(2), 4, CPU, DecodeCascade(3, 8)).shared_prefixes == ()
    assert [g.span_indices for g in AttentionBatch.build(rows(2), 4, CPU).shared_prefixes] == [(0, 1)]
    kept = AttentionBatch.build(rows(3), 4, CPU, DecodeCascade(3, 8))
    assert [g.span_indices for g in kept.shared_prefixes] == [(0, 1, 2)]
    assert AttentionBatch.build(rows(5), 4, CPU, narrow).shared_prefixes == ()
    assert [g.span_indices for g in AttentionBatch.build(rows(6), 4, CPU, narrow).shared_prefixes] == [
        tuple(range(6))
    ]


def test_the_decode_cascade_rule_follows_the_flash_kernels_copy() -> None:
    """The wide copy's rule where the native kernels copy K/V 16 keys at a time for the
    pool's dtype and head size, the 8-key copy's where 8, the key-at-a-time one's elsewhere,
    every segment off the native path."""
    cpu = torch.device("cpu")
    gather_keys = kernels.flash_gather_keys()
    rules = {
        16: attention.WIDE_GATHER_CASCADE,
        8: attention.NARROW_GATHER_CASCADE,
        1: attention.KEY_GATHER_CASCADE,
    }
    for dtype in (torch.float32, torch.bfloat16):
        for head_dim in (24, 32, 64, 1024):
            got = attention.decode_cascade(cpu, dtype, head_dim)
            if kernels.paged_decode() is None:
                assert got == EVERY_SEGMENT
            else:
                assert got == rules[gather_keys(head_dim, dtype == torch.bfloat16)]
    assert attention.decode_cascade(cpu, torch.float16, 32) == EVERY_SEGMENT
    assert attention.decode_cascade(torch.device("cuda"), torch.bfloat16, 32) == EVERY_SEGMENT


def test_a_prefill_member_keeps_its_segment() -> None:
    spans = _decode_spans([[1, 2, 10], [1, 2, 11]], 4) + [SpanInput([1, 2, 12], 8, 3)]
    batch = AttentionBatch.build(spans, 4, CPU, DecodeCascade(3, 10**6))
    assert [g.span_indices for g in batch.shared_prefixes] == [(0, 1, 2)]


def test_a_nested_segment_goes_with_its_dropped_parent() -> None:
    """Rows 0-2 share block 1 (3 x 4 reads, dropped); rows 0-1 then share 6 more blocks (48
    reads, enough alone): kept alone it would leave block 1 unread by rows 0 and 1."""
    deep = [2, 3, 4, 5, 6, 7]
    tables = [[1, *deep, 20], [1, *deep, 21], [1, 30, 31, 32, 33, 34, 35, 36]]
    plan = plan_attention([0, 1, 2], [1, 1, 1], [31, 31, 31], np.array(tables), 4, DecodeCascade(2, 40))
    assert plan.segments == ()
    assert (
        plan_attention([0, 1, 2], [1, 1, 1], [31, 31, 31], np.array(tables), 4, DecodeCascade(2, 12)).segments
        != ()
    )


def test_segments_stop_before_unshareable_blocks() -> None:
    tables = np.array([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    # The third row may share only its first block (its queries sit in the second).
    segments = find_segments(tables, np.array([3, 3, 1]))
    assert [(s.span_indices, s.first_block, s.num_blocks) for s in segments] == [
        ((0, 1, 2), 0, 1),
        ((0, 1), 1, 2),
    ]
    assert find_segments(tables, np.array([0, 0, 3])) == []


def test_kernel_calls_do_not_grow_with_the_batch() -> None:
    """8 or 64 decode rows over one shared prefix: the same tiles, so the same calls."""

    def tiles(num_spans: int) -> list[tuple[bool, int, int]]:
        shared = list(range(64))
        spans = [
            SpanInput(shared + [100 + 4 * i, 101 + 4 * i, 102 + 4 * i], 64 * 16 + 40, 1)
            for i in range(num_spans)
        ]
        batch = AttentionBatch.build(spans, 16, CPU)
        return [(t.causal, t.num_queries > 1, t.num_keys) for t in batch.tiles]

    assert tiles(8) == tiles(64)
    assert len(tiles(64)) == 2  # the shared segment, and every private context in one tile


def test_decode_rows_of_like_length_share_one_tile() -> None:
    """Private contexts that pad to at most twice their keys are one tile (one kernel call
    a layer), and a decode step's single tile reads q and writes its result in place;
    contexts far apart split by powers of two."""

    def tiles(contexts: list[int]) -> list[tuple[int, int, bool]]:
        spans = [SpanInput(list(range(20 * i, 20 * i + 20)), n - 1, 1) for i, n in enumerate(contexts)]
        batch = AttentionBatch.build(spans, 4, CPU)
        return [(t.num_items, t.num_keys, t.in_order) for t in batch.tiles]

    assert tiles([40, 70, 33]) == [(3, 70, True)]  # 143 keys, 210 padded: one tile
    assert tiles([5, 70, 7]) == [(2, 7, False), (1, 70, False)]  # 82 keys would pad to 210


def test_a_full_hit_reads_its_last_position_from_the_pool() -> None:
    """write_kv=False: the recomputed position's K/V comes from the committed block."""
    gen = torch.Generator().manual_seed(3)
    pool = KVPool(1, 8, 4, 2, 8, torch.float32, CPU)
    pool.key(0).copy_(torch.randn(8, 4, 2, 8, generator=gen))
    pool.value(0).copy_(torch.randn(8, 4, 2, 8, generator=gen))
    before = pool.kv.clone()
    batch = AttentionBatch.build([SpanInput([5, 2], 7, 1, write_kv=False)], 4, CPU)
    q = torch.randn(1, 4, 8, generator=gen)
    garbage = torch.full((1, 2, 8), 1e3)
    out = paged_attention(q, garbage, garbage, 0, batch, pool, scale=8**-0.5)
    assert torch.equal(pool.kv, before)
    k = torch.cat([pool.key(0)[5], pool.key(0)[2]])  # (8, 2, 8)
    v = torch.cat([pool.value(0)[5], pool.value(0)[2]])
    expected = _dense(q, [k], [v], 4, 2, 8, [7], [8])
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def _same_batch(a: AttentionBatch, b: AttentionBatch) -> None:
    """Every field a forward reads, equal (tiles by their tensors)."""
    for name in ("positions", "write_slots", "write_token_index", "last_token_index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("query_starts", "query_lens", "context_lens", "tables"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.max_position == b.max_position
    assert a.shared_prefixes == b.shared_prefixes
    assert (a.merge_index is None) == (b.merge_index is None)
    if a.merge_index is not None:
        assert torch.equal(a.merge_index, b.merge_index)
    assert len(a.tiles) == len(b.tiles)
    for x, y in zip(a.tiles, b.tiles):
        for name in ("query_rows", "key_slots", "key_lens", "valid", "valid_rows"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
        assert (x.causal, x.num_items, x.num_queries, x.num_keys, x.in_order) == (
            y.causal,
            y.num_items,
            y.num_queries,
            y.num_keys,
            y.in_order,
        )


@pytest.mark.parametrize("cascade", [EVERY_SEGMENT, DecodeCascade(3, 40), DecodeCascade(6, 16 * 1024)])
@pytest.mark.parametrize("seed", range(10))
def test_a_burst_step_is_the_batch_a_fresh_build_makes(seed: int, cascade: DecodeCascade) -> None:
    """`next_decode` over 20 decode steps of rows behind nested shared prefixes, each
    entering new blocks at its own time: field for field what `build` makes."""
    rng = random.Random(seed)
    block = 4
    spans, _, _, _ = _random_step(rng, block, rng.randint(1, 12))
    spans = [SpanInput(s.block_table, s.num_computed_tokens + s.num_new_tokens - 1, 1) for s in spans]
    fresh_blocks = iter(range(1000, 2000))
    batch = AttentionBatch.build(spans, block, CPU, cascade)
    for _ in range(20):
        grown = []
        for s in spans:
            table = list(s.block_table)
            if len(table) * block < s.num_computed_tokens + 2:
                table.append(next(fresh_blocks))
            grown.append(SpanInput(table, s.num_computed_tokens + 1, 1))
        spans = grown
        batch = batch.next_decode(spans, cascade)
        _same_batch(batch, AttentionBatch.build(spans, block, CPU, cascade))


def test_a_burst_step_plans_afresh_where_a_block_becomes_shared() -> None:
    """Row 0 fills block 7, which row 1 already holds at the same depth (no decode step
    does that, but the plan must not assume it): the next step has a longer segment."""
    spans = [SpanInput([1, 2, 7, 8], 11, 1), SpanInput([1, 2, 7, 9], 12, 1)]
    batch = AttentionBatch.build(spans, 4, CPU)
    later = [SpanInput([1, 2, 7, 8], 12, 1), SpanInput([1, 2, 7, 9], 13, 1)]
    assert [s.block_ids for s in batch.shared_prefixes] == [(1, 2)]
    assert [s.block_ids for s in batch.next_decode(later).shared_prefixes] == [(1, 2, 7)]
    _same_batch(batch.next_decode(later), AttentionBatch.build(later, 4, CPU))


def test_a_burst_step_checks_its_tables() -> None:
    batch = AttentionBatch.build([SpanInput([1], 3, 1)], 4, CPU)
    with pytest.raises(ValueError, match="cannot hold"):
        batch.next_decode([SpanInput([1], 4, 1)])
