"""Paged flash attention on CUDA, written in Triton: the CUDA side of `computed.attention`.

One kernel serves every tile of a step (decode rows, prefill chunks, cascade segments),
with the contract of the native CPU op `kvcache::paged_flash` (paged_flash.cpp):

    paged_flash(q, keys, values, key_slots, key_lens, causal, scale) -> (out, lse)
      q         (I, Qm, H, D)   the query rows of each item (any float dtype)
      keys      (S, Hkv, D)     one row per pool slot (a layer's key cache viewed flat)
      values    (S, Hkv, D)
      key_slots (I, Lm)         int64, the pool slots item i reads, in order
      key_lens  (I,)            int64, item i reads key_slots[i, :key_lens[i]] (>= 1)
      causal    bool            query row r sees keys 0..r only (top-left aligned)
      out       (I, Qm, H, D)   float32, softmax(q k^T * scale) v per query head
      lse       (I, Qm, H)      float32, natural log-sum-exp of the scaled scores

Keys are read straight from the pool through the slot list, once per item and K/V head:
a program owns one item, one K/V head and a block of rows, the query heads of that K/V
head folded into its rows (row r is position r // g, head kvh * g + r % g), as the CPU
kernel does. Scores and the running softmax stay in float32 (base 2); float32 inputs are
multiplied in IEEE float32, not tf32, so a float32 model keeps float32 attention. Rows
past an item's real queries get finite values (they see key 0) and callers drop them.

Triton is optional: `paged_flash()` is None where it cannot be imported (or with
`COMPUTED_TRITON=0`), `supports()` is False where the head size is not a power of two
from 16 to 256, and `computed.attention` keeps its float32 matmul path there. `python -m bench.gpu_attention` times it against that path on a CUDA device;
on an H100 (torch 2.11, Triton 3.6; one layer, Qwen3-0.6B's 16/8 heads of 128, bfloat16,
block size 16, ms per `paged_attention` call, Triton against matmul; two runs on two
machines of that kind, which differed by up to 2.8x on the shared-prefix shape):
    256 decode rows x 1,024 context                      0.51-0.62 against  9.9-10.2
    256 decode rows x 2,048 context                      0.90-1.00 against 20.2-20.5
    256 decode rows over a shared 1,024 prefix + 64      0.41-1.15 against  1.16-1.72
    16 causal chunks x 1,024 new tokens                  0.59-0.71 against 10.4-10.6
    64 chunks x 64 new after a shared 1,024 prefix       0.58-0.81 against  3.06-3.22
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

# Rows of a program for tiles of many query rows (prefill chunks, shared segments), and
# for tiles of one position per item (decode rows: only g of them are real, so the
# smallest tile tl.dot takes). Keys per iteration of the inner loop.
BLOCK_ROWS = 64
BLOCK_ROWS_DECODE = 16
BLOCK_KEYS = 64
ENV = "COMPUTED_TRITON"  # "0" keeps the matmul path on CUDA (for A/B runs)


@functools.cache
def paged_flash() -> Callable | None:
    """The Triton op (see the module docstring), or None where Triton is not installed or
    `COMPUTED_TRITON=0` (read once per process)."""
    if os.environ.get(ENV, "1") in ("0", "false", "no"):
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return _paged_flash


def supports(head_dim: int, group: int) -> bool:
    """Whether the kernel takes this head size and query heads per K/V head."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and group >= 1


def _paged_flash(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_slots: torch.Tensor,
    key_lens: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    items, width_q, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    assert num_heads == group * num_kv_heads, f"{num_heads} query heads for {num_kv_heads} K/V heads"
    assert keys.shape == values.shape and keys.shape[2] == head_dim, (keys.shape, values.shape, q.shape)
    assert key_slots.shape[0] == items and key_lens.shape == (items,), (key_slots.shape, key_lens.shape)
    assert supports(head_dim, group), f"head size {head_dim} is not a power of two in 16..256"
    q = q.contiguous()
    keys, values = keys.contiguous(), values.contiguous()
    key_slots, key_lens = key_slots.contiguous(), key_lens.contiguous()
    out = torch.empty(items, width_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(items, width_q, num_heads, dtype=torch.float32, device=q.device)
    rows = width_q * group
    block_rows = BLOCK_ROWS_DECODE if rows <= BLOCK_ROWS_DECODE else BLOCK_ROWS
    grid = (triton.cdiv(rows, block_rows), items, num_kv_heads)
    _kernel()[grid](
        q,
        keys,
        values,
        key_slots,
        key_lens,
        out,
        lse,
        width_q,
        key_slots.shape[1],
        scale * 1.4426950408889634,  # scores in base 2: exp(x) = 2^(x log2 e)
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_rows,
        BLOCK_N=BLOCK_KEYS,
        CAUSAL=causal,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    return out, lse


def warm_up(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Compile the kernel's variants for this model's heads before serving, so no request
    waits on a compile: causal or not, decode-sized or full row blocks, and each length
    case Triton specializes on (1, a multiple of 16, any other)."""
    op = paged_flash()
    if op is None or not supports(head_dim, num_heads // num_kv_heads):
        return
    keys = torch.zeros(BLOCK_KEYS, num_kv_heads, head_dim, dtype=dtype, device=device)
    for width_q in (1, 16, 17, BLOCK_ROWS, BLOCK_ROWS + 1):
        q = torch.zeros(1, width_q, num_heads, head_dim, dtype=dtype, device=device)
        for width_k in (1, 16, 17):
            slots = torch.arange(width_k, device=device)[None, :]
            lens = torch.tensor([width_k], device=device)
            for causal in (False, True):
                op(q, keys, keys, slots, lens, causal, 1.0)


@functools.cache
def _kernel():
    """The jitted kernel, defined on first use so that importing this module needs no Triton."""
    import triton
    import triton.language as tl

    # Triton compiles a variant per length case (1, a multiple of 16, other): `warm_up`
    # compiles them all at start (15 s on an H100 the first time; Triton keeps them on disk).
    @triton.jit
    def paged_flash_kernel(
        Q,  # (I, Qm, H, D)
        K,  # (S, Hkv, D)
        V,
        SLOTS,  # (I, Lm) int64
        LENS,  # (I,) int64
        OUT,  # (I, Qm, H, D) float32
        LSE,  # (I, Qm, H) float32
        width_q,
        width_k,
        scale_log2,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        row_block = tl.program_id(0)
        item = tl.program_id(1).to(tl.int64)
        kv_head = tl.program_id(2)
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # folded rows of this K/V head
        position = rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = position < width_q
        dims = tl.arange(0, HEAD_DIM)

        q_row = (item * width_q + position) * NUM_HEADS + head  # (BLOCK_M,) row of q viewed (I*Qm*H, D)
        q = tl.load(Q + q_row[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
        key_len = tl.load(LENS + item)
        end = key_len
        if CAUSAL:  # no row of this block sees past its last position
            end = tl.minimum(key_len, (row_block * BLOCK_M + BLOCK_M - 1) // GROUP + 1)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for start in range(0, end, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < key_len
            slot = tl.load(SLOTS + item * width_k + cols, mask=col_ok, other=0)
            kv_row = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM  # (BLOCK_N,) int64
            k = tl.load(K + kv_row[:, None] + dims[None, :], mask=col_ok[:, None], other=0.0)
            v = tl.load(V + kv_row[:, None] + dims[None, :], mask=col_ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale_log2
            seen = col_ok[None, :]
            if CAUSAL:
                seen = seen & (cols[None, :] <= position[:, None])
            s = tl.where(seen, s, float("-inf"))
            # Every row sees key 0 in the first block, so m_new is finite from there on.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        out = acc / l_i[:, None]
        out_row = (item * width_q + position) * NUM_HEADS + head
        tl.store(OUT + out_row[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None])
        tl.store(LSE + out_row, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=row_ok)

    return paged_flash_kernel
