"""The CUDA path: the Triton paged flash kernel and the batched attention on a GPU.

Skipped without CUDA (CI has none); run on a GPU host with `pytest -m gpu`. The daemons'
own suites run on CUDA too when started with `COMPUTED_DEVICE=cuda COMPUTED_DTYPE=float32`
(BENCHMARKS.md, GPU mode, says how they were run).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from computed import attention, triton_attention
from computed.attention import AttentionBatch, paged_attention
from computed.kv_pool import KVPool
from tests.computed.test_attention import _dense, _fill, _random_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
CUDA = torch.device("cuda")


def _reference(q, keys, values, slots, lens, causal: bool, scale: float):
    """paged_flash's contract in float64 on the host, item by item and head by head."""
    q, keys, values, slots, lens = (t.cpu() for t in (q, keys, values, slots, lens))
    items, width_q, heads, dim = q.shape
    group = heads // keys.shape[1]
    out = torch.zeros(items, width_q, heads, dim, dtype=torch.float64)
    lse = torch.zeros(items, width_q, heads, dtype=torch.float64)
    for i in range(items):
        k = keys[slots[i, : lens[i]]].double()  # (L, Hkv, D)
        v = values[slots[i, : lens[i]]].double()
        for r in range(width_q):
            seen = min(int(lens[i]), r + 1) if causal else int(lens[i])
            scores = (
                torch.einsum("hd,lhd->hl", q[i, r].double(), k[:seen].repeat_interleave(group, 1)) * scale
            )
            lse[i, r] = scores.logsumexp(-1)
            out[i, r] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[:seen].repeat_interleave(group, 1))
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "items,width_q,heads,kv_heads,dim,causal",
    [
        (5, 1, 16, 8, 128, False),  # decode rows, Qwen3-0.6B's heads
        (3, 1, 4, 1, 64, False),  # a group of 4 folded into the rows
        (2, 70, 8, 8, 32, True),  # a prefill chunk past one 64-row block
        (3, 33, 4, 2, 16, True),
        (4, 9, 8, 2, 128, False),  # a shared segment read by several queries
    ],
)
def test_triton_paged_flash_matches_float64(items, width_q, heads, kv_heads, dim, causal, dtype) -> None:
    gen = torch.Generator().manual_seed(items * 1000 + width_q)
    slots_in_pool = 600
    width_k = width_q if causal else 150
    keys = torch.randn(slots_in_pool, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(slots_in_pool, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(items, width_q, heads, dim, generator=gen).to(dtype)
    slots = torch.stack([torch.randperm(slots_in_pool, generator=gen)[:width_k] for _ in range(items)])
    lens = torch.tensor([width_k if causal else width_k - 7 * i for i in range(items)])  # padded keys
    scale = 1 / math.sqrt(dim)
    op = triton_attention.paged_flash()
    assert op is not None, "Triton is part of CUDA builds of torch"
    out, lse = op(q.to(CUDA), keys.to(CUDA), values.to(CUDA), slots.to(CUDA), lens.to(CUDA), causal, scale)
    ref_out, ref_lse = _reference(q, keys, values, slots, lens, causal, scale)
    assert out.dtype == lse.dtype == torch.float32 and torch.isfinite(out).all() and torch.isfinite(lse).all()
    error = float((out.cpu().double() - ref_out).norm() / ref_out.norm())
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), error
    torch.testing.assert_close(
        lse.cpu().double(), ref_lse, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=0
    )


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "matmul"])
@pytest.mark.parametrize("seed", range(8))
def test_random_steps_on_cuda_match_dense_attention(seed: int, triton: bool, monkeypatch) -> None:
    """Decode rows, prefill chunks and nested shared prefixes in one step, on the GPU,
    through the Triton kernel and through the matmul fallback."""
    if not triton:
        monkeypatch.setattr(triton_attention, "paged_flash", lambda: None)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = rng.choice([(4, 2, 16), (16, 8, 128), (8, 1, 32), (4, 4, 64)])
    block = rng.choice([4, 16])
    spans, tables, cached, lengths = _random_step(rng, block, rng.randint(1, 12))
    host_pool = KVPool(1, 400, block, kv_heads, dim, torch.float32, torch.device("cpu"))
    keys, values = _fill(host_pool, tables, cached, kv_heads, dim, gen)
    pool = KVPool(1, 400, block, kv_heads, dim, torch.float32, CUDA)
    pool.key(0).copy_(host_pool.key(0))
    pool.value(0).copy_(host_pool.value(0))
    batch = AttentionBatch.build(spans, block, CUDA)
    k_new = torch.randn(batch.num_tokens, kv_heads, dim, generator=gen)
    v_new = torch.randn(batch.num_tokens, kv_heads, dim, generator=gen)
    q = torch.randn(batch.num_tokens, heads, dim, generator=gen)
    start = 0
    for i, (c, n) in enumerate(zip(cached, lengths)):
        keys[i] = torch.cat([keys[i], k_new[start : start + n - c]])
        values[i] = torch.cat([values[i], v_new[start : start + n - c]])
        start += n - c
    out = paged_attention(q.to(CUDA), k_new.to(CUDA), v_new.to(CUDA), 0, batch, pool, scale=dim**-0.5)
    torch.testing.assert_close(
        out.cpu(), _dense(q, keys, values, heads, kv_heads, dim, cached, lengths), atol=2e-5, rtol=1e-4
    )
    slots = batch.write_slots.cpu()
    torch.testing.assert_close(pool.key(0).view(-1, kv_heads, dim)[slots.to(CUDA)].cpu(), k_new)


def test_cuda_tiles_use_the_triton_kernel(monkeypatch) -> None:
    """Every tile of a CUDA step goes through the kernel (no silent matmul fallback)."""
    calls = []
    op = triton_attention.paged_flash()
    monkeypatch.setattr(triton_attention, "paged_flash", lambda: lambda *a: calls.append(a) or op(*a))
    monkeypatch.setattr(attention, "_attend_tile_matmul", None)  # a fallback would raise
    rng = random.Random(3)
    spans, *_ = _random_step(rng, 16, 10)
    pool = KVPool(1, 400, 16, 8, 128, torch.bfloat16, CUDA)
    batch = AttentionBatch.build(spans, 16, CUDA)
    q = torch.randn(batch.num_tokens, 16, 128, device=CUDA, dtype=torch.bfloat16)
    kv = torch.randn(batch.num_tokens, 8, 128, device=CUDA, dtype=torch.bfloat16)
    out = paged_attention(q, kv, kv, 0, batch, pool, scale=128**-0.5)
    assert len(calls) == len(batch.tiles) and torch.isfinite(out).all()
