"""`computed.triton_layers` against the modules' torch ops: close (another summation
order), with the model's dtype rounded where torch rounds it. Needs CUDA and Triton;
the `check_*` functions also run on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`, what the CPU-only sessions checked them with)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from computed.model.layers import RMSNorm
from computed.model.rope import apply_rotary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
DTYPES = [torch.float32, torch.bfloat16]


def _tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def check_norms(device: torch.device, dtype: torch.dtype, exact_sum: bool = True) -> None:
    """`exact_sum`: the residual sum bit for bit torch's (on a GPU; Triton's interpreter
    truncates float32 to bfloat16 where the GPU rounds to nearest)."""
    from computed import triton_layers

    gen = torch.Generator().manual_seed(0)
    for rows, size in ((1, 64), (7, 96), (33, 1024)):
        norm = RMSNorm(size, 1e-6).to(device=device, dtype=dtype)
        norm.weight.data = (1 + 0.1 * torch.randn(size, generator=gen)).to(device=device, dtype=dtype)
        x = torch.randn(rows, size, generator=gen).to(device=device, dtype=dtype)
        r = torch.randn(rows, size, generator=gen).to(device=device, dtype=dtype)
        torch.testing.assert_close(triton_layers.rms_norm(x, norm.weight, 1e-6), norm(x), **_tolerance(dtype))
        out, summed = triton_layers.add_rms_norm(x, r, norm.weight, 1e-6)
        if exact_sum:
            assert torch.equal(summed, x + r), "the residual sum is torch's, in the model's dtype"
        torch.testing.assert_close(summed, x + r, **_tolerance(dtype))
        torch.testing.assert_close(out, norm(x + r), **_tolerance(dtype))


def check_silu_mul(device: torch.device, dtype: torch.dtype) -> None:
    from computed import triton_layers

    gen = torch.Generator().manual_seed(1)
    for rows, half in ((1, 64), (5, 1500), (16, 3072)):
        gate_up = torch.randn(rows, 2 * half, generator=gen).to(device=device, dtype=dtype)
        gate, up = gate_up.split(half, dim=-1)
        torch.testing.assert_close(triton_layers.silu_mul(gate_up), F.silu(gate) * up, **_tolerance(dtype))


def check_qk_norm_rotary(device: torch.device, dtype: torch.dtype) -> None:
    from computed import triton_layers

    gen = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, dim = 9, 8, 2, 64
    q = torch.randn(tokens, heads, dim, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(device=device, dtype=dtype)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(device=device, dtype=dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(device=device, dtype=dtype)
    q_norm, k_norm = (RMSNorm(dim, 1e-6).to(device=device, dtype=dtype) for _ in range(2))
    q_norm.weight.data = (1 + 0.1 * torch.randn(dim, generator=gen)).to(device=device, dtype=dtype)
    k_norm.weight.data = (1 + 0.1 * torch.randn(dim, generator=gen)).to(device=device, dtype=dtype)
    got_q, got_k = triton_layers.qk_norm_rotary(q, k, None, None, 1e-6, cos, sin)  # Llama, Qwen2: rotary only
    torch.testing.assert_close(got_q, apply_rotary(q, cos, sin), **_tolerance(dtype))
    torch.testing.assert_close(got_k, apply_rotary(k, cos, sin), **_tolerance(dtype))
    got_q, got_k = triton_layers.qk_norm_rotary(q, k, q_norm.weight, k_norm.weight, 1e-6, cos, sin)  # Qwen3
    torch.testing.assert_close(got_q, apply_rotary(q_norm(q), cos, sin), **_tolerance(dtype))
    torch.testing.assert_close(got_k, apply_rotary(k_norm(k), cos, sin), **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_match_the_module(dtype: torch.dtype) -> None:
    check_norms(torch.device("cuda"), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype: torch.dtype) -> None:
    check_silu_mul(torch.device("cuda"), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rotary_matches_the_modules(dtype: torch.dtype) -> None:
    check_qk_norm_rotary(torch.device("cuda"), dtype)
