"""A decoder layer's small ops on CUDA as single Triton kernels (issue 42, item 3).

An eager layer in torch launches seven kernels per RMSNorm (cast, square, mean, add,
rsqrt, multiply, scale), three for SiLU·mul over the strided halves of the gate/up
product, and about ten for rotary on q and k: most of a decode step's launches on a
GPU. Here each is one kernel, reading its input once:

    rms_norm(x, w, eps)                    (N, D) -> (N, D)
    add_rms_norm(x, residual, w, eps)      -> (norm(x + residual), x + residual)
    silu_mul(gate_up)                      (N, 2I) -> (N, I)
    qk_norm_rotary(q, k, q_w, k_w, eps, cos, sin)   Qwen3's q/k norms (optional) and rotary

They compute what the modules compute, rounding to the model's dtype where torch does
(after the norm, each product and sum of rotary, the activation), in float32 within;
sums run in another order than torch's, so results are close, not the same bits
(tests/computed/test_triton_layers.py, `gpu`). Off unless `COMPUTED_TRITON_LAYERS=1`:
unmeasured until a GPU run times them against the eager ops and CUDA graphs (which
already remove the launches' host cost); `CausalLM.choose_attention_backend` turns them
on with the cuda_triton backend only.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "COMPUTED_TRITON_LAYERS"  # "1" turns the fused layer ops on (CUDA with Triton)


def enabled(device: torch.device) -> bool:
    """Whether a model on `device` runs its layers' small ops here."""
    if device.type != "cuda" or os.environ.get(ENV, "0") not in ("1", "true", "yes"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm.forward`: x (..., D) -> weight * (x / rms(x)) in x's dtype."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s), s) for s = x + residual in x's dtype: a layer's residual add and the
    norm after it in one pass."""
    return _norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (N, 2I), gate's columns then up's -> silu(gate) * up (N, I)."""
    num_rows, width = gate_up.shape
    half = width // 2
    gate_up = gate_up.contiguous()
    out = torch.empty(num_rows, half, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _kernels()["silu_mul"][(num_rows, -(-half // block))](gate_up, out, half, BLOCK=block)
    return out


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, D), k (T, Hkv, D): each head row normed by its weight (where given: Qwen3),
    then rotated by cos/sin (T, D) -> new q, k. D a power of two."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim & (head_dim - 1) == 0 and head_dim >= 2, f"head size {head_dim} is not a power of two"
    q, k, cos, sin = q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    norm = q_weight is not None
    kernel = _kernels()["qk_norm_rotary"]
    for x, out, heads, weight in ((q, q_out, num_heads, q_weight), (k, k_out, num_kv_heads, k_weight)):
        kernel[(num_tokens, heads)](
            x, out, weight if norm else x, cos, sin, heads, eps, HALF=head_dim // 2, NORM=norm
        )
    return q_out, k_out


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    shape, size = x.shape, x.shape[-1]
    rows = x.reshape(-1, size).contiguous()
    res = rows if residual is None else residual.reshape(-1, size).contiguous()
    out = torch.empty_like(rows)
    summed = rows if residual is None else torch.empty_like(rows)
    _kernels()["norm"][(rows.shape[0],)](
        rows, res, summed, out, weight.contiguous(), size, eps,
        BLOCK=triton.next_power_of_2(size), ADD=residual is not None,
    )  # fmt: skip
    return out.view(shape), summed.view(shape)


@functools.cache
def _kernels() -> dict:
    """The jitted kernels, defined on first use so that importing this module needs no Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def norm_kernel(X, R, S, OUT, W, size, eps, BLOCK: tl.constexpr, ADD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < size
        x = tl.load(X + row * size + cols, mask=ok, other=0.0)
        if ADD:  # the sum in the model's dtype, as torch's `x + residual`
            x = (x.to(tl.float32) + tl.load(R + row * size + cols, mask=ok, other=0.0).to(tl.float32)).to(
                X.dtype.element_ty
            )
            tl.store(S + row * size + cols, x, mask=ok)
        x32 = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / size + eps)
        y = (x32 * inv).to(X.dtype.element_ty).to(tl.float32)  # cast back, then the weight
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + row * size + cols, (w * y).to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def silu_mul_kernel(GU, OUT, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < half
        gate = tl.load(GU + row * 2 * half + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(GU + row * 2 * half + half + cols, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(OUT.dtype.element_ty).to(tl.float32)
        tl.store(OUT + row * half + cols, (act * up).to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def qk_norm_rotary_kernel(X, OUT, W, COS, SIN, heads, eps, HALF: tl.constexpr, NORM: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        base = (token * heads + head) * 2 * HALF
        lo = tl.arange(0, HALF)
        dtype = OUT.dtype.element_ty
        x1 = tl.load(X + base + lo).to(tl.float32)  # (HALF,) the first half of the head
        x2 = tl.load(X + base + HALF + lo).to(tl.float32)
        if NORM:
            inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
            w1 = tl.load(W + lo).to(tl.float32)
            w2 = tl.load(W + HALF + lo).to(tl.float32)
            x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        c1 = tl.load(COS + token * 2 * HALF + lo).to(tl.float32)
        c2 = tl.load(COS + token * 2 * HALF + HALF + lo).to(tl.float32)
        s1 = tl.load(SIN + token * 2 * HALF + lo).to(tl.float32)
        s2 = tl.load(SIN + token * 2 * HALF + HALF + lo).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), each product and the
        # sum rounded to the model's dtype as torch's ops round them.
        out1 = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
        out2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
        tl.store(OUT + base + lo, out1.to(dtype))
        tl.store(OUT + base + HALF + lo, out2.to(dtype))

    return {"norm": norm_kernel, "silu_mul": silu_mul_kernel, "qk_norm_rotary": qk_norm_rotary_kernel}
