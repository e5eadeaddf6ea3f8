"""The native CPU kernels with a bfloat16 KV pool: write_kv stores each row as
`.to(torch.bfloat16)` rounds it, and paged_decode / paged_flash give bit for bit what they
give with the same pool widened to float32 (a bfloat16 is the top half of a float32)."""

from __future__ import annotations

import pytest
import torch

from computed import kernels

if kernels.paged_flash() is None:
    pytest.skip(f"the native kernels are not built here: {kernels.error()}", allow_module_level=True)

# float32 bit patterns that rounding to bfloat16 must get right (round to nearest, ties to
# even): ties to an even and to an odd kept half, either side of a tie, negative ties,
# denormals, the largest float rounding up to inf, infinities, signed zero, and NaNs whose
# payload a naive "add 0x7FFF, drop the low half" would carry into inf or wrap to 0.
_SPECIAL_BITS = [
    0x3F808000,  # 1 + 2^-8: a tie, kept half even -> down
    0x3F818000,  # a tie, kept half odd -> up
    0x3F807FFF,  # just below a tie -> down
    0x3F808001,  # just above a tie -> up
    0xBF818000,  # a negative tie -> away from zero (to even)
    0xBF808000,  # a negative tie -> towards zero (to even)
    0x00008000,  # a denormal tie -> 0
    0x00018000,  # a denormal tie -> up
    0x80000001,  # the smallest negative denormal -> -0
    0x7F7FFFFF,  # the largest float -> inf
    0x7F7F7FFF,  # large, rounds down
    0xFF7F8000,  # large negative tie, odd -> -inf
    0x7F800000,  # inf
    0xFF800000,  # -inf
    0x80000000,  # -0
    0x7F800001,  # NaN: naive rounding gives inf
    0xFFFFFFFF,  # NaN: naive rounding wraps to 0
    0x7FC00000,  # the quiet NaN
]


def _special_floats() -> torch.Tensor:
    bits = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in _SPECIAL_BITS], dtype=torch.int32)
    return bits.view(torch.float32)


def _assert_same_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, but for a NaN's payload (torch's conversion gives 0xFFFF on x86, 0x7FC0
    in its scalar path): NaN where want has NaN, the same bits everywhere else."""
    assert got.dtype == want.dtype == torch.bfloat16
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "kv_heads", "dim"), [(1, 2, 8), (8, 4, 32), (300, 3, 5), (17, 1, 20)])
def test_write_kv_is_index_copy_of_rounded_rows(
    dtype: torch.dtype, tokens: int, kv_heads: int, dim: int
) -> None:
    """Rows of k and of a strided v (a column block of a fused product), with values that
    need rounding and special values, land in slots out of order as index_copy_ of their
    `.to(dtype)` puts them; other slots keep their values."""
    op = kernels.write_kv()
    gen = torch.Generator().manual_seed(tokens * 100 + dim)
    num_slots, row = 512, kv_heads * dim
    keys, values = (torch.randn(2, num_slots, kv_heads, dim, generator=gen) * 3).to(dtype).unbind(0)
    keys, values = keys.contiguous(), values.contiguous()
    qkv = torch.randn(tokens, 3 * row, generator=gen) * torch.logspace(-30, 30, 3 * row, base=2)
    picks = torch.randperm(qkv.numel(), generator=gen)[: qkv.numel() // 4]  # special values anywhere
    special = _special_floats()
    qkv.view(-1)[picks] = special[torch.randint(0, special.numel(), (picks.numel(),), generator=gen)]
    k, v = qkv[:, row : 2 * row].view(tokens, kv_heads, dim), qkv[:, 2 * row :].view(tokens, kv_heads, dim)
    assert tokens == 1 or not v.is_contiguous()
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    assert tokens == 1 or not torch.equal(slots, slots.sort().values)
    want_k = keys.clone().index_copy_(0, slots, k.to(dtype))
    want_v = values.clone().index_copy_(0, slots, v.to(dtype))
    op(keys, values, k, v, slots)
    if dtype == torch.bfloat16:
        _assert_same_bf16(keys, want_k)
        _assert_same_bf16(values, want_v)
    else:  # float32: a plain copy, NaN payloads and all
        assert torch.equal(keys.view(torch.int32), want_k.view(torch.int32))
        assert torch.equal(values.view(torch.int32), want_v.view(torch.int32))


def test_write_kv_rounds_every_special_value() -> None:
    """One row of the special values alone: each rounded exactly as torch rounds it."""
    special = _special_floats()
    keys = torch.zeros(4, 1, special.numel(), dtype=torch.bfloat16)
    values = torch.zeros_like(keys)
    k = special.view(1, 1, -1)
    kernels.write_kv()(keys, values, k, -k, torch.tensor([2]))
    _assert_same_bf16(keys[2, 0], special.to(torch.bfloat16))
    _assert_same_bf16(values[2, 0], (-special).to(torch.bfloat16))
    want = torch.tensor(
        [0x3F80, 0x3F82, 0x3F80, 0x3F81, 0xBF82, 0xBF80, 0x0000, 0x0002, 0x8000]
        + [0x7F80, 0x7F7F, 0xFF80, 0x7F80, 0xFF80, 0x8000],
        dtype=torch.int32,
    )
    assert torch.equal(keys[2, 0, : want.numel()].view(torch.int16).int() & 0xFFFF, want)
    assert keys[2, 0, want.numel() :].isnan().all()
    assert not keys[[0, 1, 3]].view(torch.int16).any()  # other slots untouched


def _pool(gen: torch.Generator, num_slots: int, kv_heads: int, dim: int):
    """A bfloat16 K/V pool (values over a wide range, a few exact zeros) and its float32 widening."""
    scale = torch.logspace(-4, 4, dim, base=2)
    keys, values = (
        (torch.randn(2, num_slots, kv_heads, dim, generator=gen) * scale).to(torch.bfloat16).unbind(0)
    )
    keys, values = keys.contiguous(), values.contiguous()
    keys[::7, :, 0] = 0
    return keys, values, keys.float(), values.float()


def _scattered_slots(
    gen: torch.Generator, items: int, width: int, num_slots: int, block: int = 16
) -> torch.Tensor:
    """Each item's keys in whole blocks of `block` slots, the blocks anywhere in the pool."""
    blocks = -(-width // block)
    starts = torch.stack([torch.randperm(num_slots // block, generator=gen)[:blocks] for _ in range(items)])
    return (starts[:, :, None] * block + torch.arange(block)).reshape(items, -1)[:, :width].contiguous()


GROUPS = [(4, 4), (8, 4), (8, 2), (4, 1)]  # (query heads, K/V heads): groups 1, 2, 4 and 4


@pytest.mark.parametrize(("heads", "kv_heads"), GROUPS)
@pytest.mark.parametrize("dim", [32, 64, 128, 20])
def test_paged_decode_bf16_pool_is_its_float32_widening(heads: int, kv_heads: int, dim: int) -> None:
    """Head sizes 32, 64 and 128 run the 16-lane kernel where there is AVX-512, 20 the
    8-lane one with a scalar tail; key lens uneven, past one block, down to 1."""
    op = kernels.paged_decode()
    gen = torch.Generator().manual_seed(heads * 1000 + kv_heads * 100 + dim)
    num_slots, width = 4096, 300
    keys, values, keys32, values32 = _pool(gen, num_slots, kv_heads, dim)
    lens = torch.tensor([300, 1, 17, 129, 64, 255])
    slots = _scattered_slots(gen, len(lens), width, num_slots)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    out, lse = op(q, keys, values, slots, lens, dim**-0.5)
    want_out, want_lse = op(q, keys32, values32, slots, lens, dim**-0.5)
    assert out.dtype == lse.dtype == torch.float32
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    # And the widened pool is what was read: item 2 against dense attention on it.
    group = heads // kv_heads
    k = keys32[slots[2, :17]].repeat_interleave(group, dim=1).double()
    v = values32[slots[2, :17]].repeat_interleave(group, dim=1).double()
    scores = torch.einsum("hd,lhd->hl", q[2].double(), k) * dim**-0.5
    torch.testing.assert_close(lse[2], scores.logsumexp(-1).float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        out[2], torch.einsum("hl,lhd->hd", scores.softmax(-1), v).float(), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads"), GROUPS)
@pytest.mark.parametrize("dim", [32, 64, 24])
def test_paged_flash_bf16_pool_is_its_float32_widening(
    causal: bool, heads: int, kv_heads: int, dim: int
) -> None:
    """Several items, key lens uneven (past one 128-key block, down to 1), query rows past
    one block of positions; head size 24 runs the 8-lane kernel."""
    op = kernels.paged_flash()
    gen = torch.Generator().manual_seed(heads * 1000 + kv_heads * 100 + dim + causal)
    num_slots, width = 4096, 300
    keys, values, keys32, values32 = _pool(gen, num_slots, kv_heads, dim)
    lens = torch.tensor([300, 1, 77, 130])
    slots = _scattered_slots(gen, len(lens), width, num_slots)
    q = torch.randn(len(lens), 140 if causal else 70, heads, dim, generator=gen)
    out, lse = op(q, keys, values, slots, lens, causal, dim**-0.5)
    want_out, want_lse = op(q, keys32, values32, slots, lens, causal, dim**-0.5)
    assert out.dtype == lse.dtype == torch.float32
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize(
    ("key_dtype", "value_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float64, torch.float64),
    ],
)
def test_pool_dtypes_other_than_float32_or_bfloat16_pairs_are_refused(
    key_dtype: torch.dtype, value_dtype: torch.dtype
) -> None:
    message = "keys and values must share a dtype, float32 or bfloat16"
    keys, values = torch.zeros(64, 2, 8, dtype=key_dtype), torch.zeros(64, 2, 8, dtype=value_dtype)
    slots, lens = torch.arange(4).view(1, 4), torch.tensor([4])
    with pytest.raises(RuntimeError, match=f"paged_decode: {message}"):
        kernels.paged_decode()(torch.zeros(1, 4, 8), keys, values, slots, lens, 1.0)
    with pytest.raises(RuntimeError, match=f"paged_flash: {message}"):
        kernels.paged_flash()(torch.zeros(1, 2, 4, 8), keys, values, slots, lens, True, 1.0)
    with pytest.raises(RuntimeError, match=f"write_kv: {message}"):
        kernels.write_kv()(keys, values, torch.ones(2, 2, 8), torch.ones(2, 2, 8), torch.tensor([0, 1]))
    assert not keys.any() and not values.any()  # nothing written by a refused call
