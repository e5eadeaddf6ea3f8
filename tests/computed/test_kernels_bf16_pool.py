"""The native CPU kernels with a bfloat16 KV pool: write_kv stores each row as
`.to(torch.bfloat16)` rounds it; paged_decode and paged_flash multiply bfloat16 values (the
pool's K/V, the scaled q and the softmax weights rounded to bfloat16, the same weights in both
kernels and in every split of the keys), otherwise the float32 pool's arithmetic."""

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


# A float32 scale whose product with the kernel's float32 log2(e) is exactly 1: the scaled q
# is q itself, so a q of bfloat16 values is unchanged by the rounding of a bfloat16 pool's q.
_UNIT_SCALE = float(torch.tensor(1 / 1.4426950408889634, dtype=torch.float32))
_LOG2E, _LN2 = torch.tensor(1.4426950408889634), torch.tensor(0.6931471805599453)  # float32, as the kernel's


def _integer_inputs(gen: torch.Generator, q: torch.Tensor, values: torch.Tensor):
    """q of small integers (mostly 0) and keys in {-1, 0, 1}: with `_UNIT_SCALE` every score
    is an integer, so the ceiling of a row max is the max and every weight a power of two,
    which the bfloat16 rounding of q and of the weights leaves as it is."""
    q = torch.randint(-2, 3, q.shape, generator=gen).float() * (torch.rand(q.shape, generator=gen) < 0.3)
    return q, torch.randint(-1, 2, values.shape, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize(("heads", "kv_heads"), GROUPS)
@pytest.mark.parametrize("dim", [32, 64, 128, 20])
def test_paged_decode_bf16_pool_is_float32_arithmetic_on_bfloat16_inputs(
    heads: int, kv_heads: int, dim: int
) -> None:
    """Where the rounding changes nothing (`_integer_inputs`), a bfloat16 pool gives the float32
    pool's result bit for bit: the same reads, chains and masks. Head sizes 32, 64 and 128 run
    the 16-lane kernel where there is AVX-512, 20 the 8-lane one with a scalar tail; key lens
    uneven, past one block, down to 1."""
    op = kernels.paged_decode()
    gen = torch.Generator().manual_seed(heads * 1000 + kv_heads * 100 + dim)
    num_slots, width = 4096, 300
    _, values, _, values32 = _pool(gen, num_slots, kv_heads, dim)
    lens = torch.tensor([300, 1, 17, 129, 64, 255])
    slots = _scattered_slots(gen, len(lens), width, num_slots)
    q, keys = _integer_inputs(gen, torch.empty(len(lens), heads, dim), values)
    out, lse = op(q, keys, values, slots, lens, _UNIT_SCALE)
    want_out, want_lse = op(q, keys.float(), values32, slots, lens, _UNIT_SCALE)
    assert out.dtype == lse.dtype == torch.float32
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def _flash_case(gen: torch.Generator, heads: int, kv_heads: int, dim: int, causal: bool):
    num_slots, width = 4096, 300
    keys, values, keys32, values32 = _pool(gen, num_slots, kv_heads, dim)
    lens = torch.tensor([300, 1, 77, 130])
    slots = _scattered_slots(gen, len(lens), width, num_slots)
    q = torch.randn(len(lens), 140 if causal else 70, heads, dim, generator=gen)
    return q, keys, values, keys32, values32, slots, lens


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads"), GROUPS)
@pytest.mark.parametrize("dim", [32, 64, 128, 24])
def test_paged_flash_bf16_pool_is_float32_arithmetic_on_bfloat16_inputs(
    causal: bool, heads: int, kv_heads: int, dim: int
) -> None:
    """Where the rounding changes nothing (`_integer_inputs`), a bfloat16 pool's result (by
    bfloat16 products where the machine has them) is the float32 pool's bit for bit: the same
    chains over the same keys and masks. Several items, key lens uneven (past one 128-key
    block, odd, down to 1), query rows past one block of positions; head size 24 runs the
    8-lane kernel."""
    op = kernels.paged_flash()
    gen = torch.Generator().manual_seed(heads * 1000 + kv_heads * 100 + dim + causal)
    q, _, values, _, values32, slots, lens = _flash_case(gen, heads, kv_heads, dim, causal)
    q, keys = _integer_inputs(gen, q, values)
    out, lse = op(q, keys, values, slots, lens, causal, _UNIT_SCALE)
    want_out, want_lse = op(q, keys.float(), values32, slots, lens, causal, _UNIT_SCALE)
    assert out.dtype == lse.dtype == torch.float32
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def _reference(q, keys32, values32, slots, lens, causal: bool, scale: float) -> torch.Tensor:
    """What the kernels compute on a bfloat16 pool, in float64 but for its roundings: the
    scaled q (scale * log2 e, float32) rounded to bfloat16, and each weight 2^(s - M) rounded
    to bfloat16, M the ceiling of the row max (any integer gives the same weights, scaled)."""
    items, width_q, heads, _ = q.shape
    group = heads // keys32.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(items):
        n = int(lens[i])
        k = keys32[slots[i, :n]].repeat_interleave(group, dim=1).double()  # (n, H, D)
        v = values32[slots[i, :n]].repeat_interleave(group, dim=1).double()
        qs = (q[i] * (torch.tensor(scale, dtype=torch.float32) * _LOG2E)).to(torch.bfloat16).double()
        s = torch.einsum("qhd,khd->hqk", qs, k)
        if causal:
            s = s.masked_fill(torch.ones(width_q, n, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.exp2(s - s.amax(-1, keepdim=True).ceil()).float().to(torch.bfloat16).double()
        out[i] = (torch.einsum("hqk,khd->hqd", p, v) / p.sum(-1, keepdim=True)).permute(1, 0, 2)
    return out


def _assert_near_reference(out: torch.Tensor, unrounded: torch.Tensor, want: torch.Tensor, values32) -> None:
    """Equal to float32 rounding but where the kernel's 2^x (within 1e-7 relative) flips a
    weight's bfloat16 rounding, which moves an output by up to 2^-8 of a value: rare, so the
    mean error stays at float32's. Without the roundings (the float32 pool) the mean error is
    a hundred times larger."""
    error = (out.double() - want).abs()
    assert error.mean() < 1e-6 and (error > 1e-5).double().mean() < 1e-3, (error.mean(), (error > 1e-5).sum())
    assert error.max() <= values32.abs().max() * 2**-8
    assert (unrounded.double() - want).abs().mean() > 100 * error.mean()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)])
@pytest.mark.parametrize("dim", [32, 64, 24])
def test_paged_flash_bf16_pool_rounds_q_and_weights(
    causal: bool, heads: int, kv_heads: int, dim: int
) -> None:
    """Random inputs against `_reference`: one weight per score whatever the 128-key block and
    its running max."""
    op = kernels.paged_flash()
    gen = torch.Generator().manual_seed(heads * 1000 + kv_heads * 100 + dim + causal)
    q, keys, values, keys32, values32, slots, lens = _flash_case(gen, heads, kv_heads, dim, causal)
    values, values32 = values / 64, values32 / 64  # the pool's wide range, scaled near 1
    real = torch.ones(q.shape[:2], dtype=torch.bool)  # rows with a query (causal: position < len)
    if causal:
        real = torch.arange(q.shape[1])[None] < lens[:, None]
    out, _ = op(q, keys, values, slots, lens, causal, dim**-0.5)
    unrounded, _ = op(q, keys32, values32, slots, lens, causal, dim**-0.5)
    want = _reference(q, keys32, values32, slots, lens, causal, dim**-0.5)
    _assert_near_reference(out[real], unrounded[real], want[real], values32)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)])
@pytest.mark.parametrize("dim", [32, 64, 20])
def test_paged_decode_bf16_pool_rounds_q_and_weights(heads: int, kv_heads: int, dim: int) -> None:
    op = kernels.paged_decode()
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + dim)
    keys, values, keys32, values32 = _pool(gen, 4096, kv_heads, dim)
    values, values32 = values / 64, values32 / 64
    lens = torch.tensor([300, 1, 17, 129, 64, 255])
    slots = _scattered_slots(gen, len(lens), 300, 4096)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    out, _ = op(q, keys, values, slots, lens, dim**-0.5)
    unrounded, _ = op(q, keys32, values32, slots, lens, dim**-0.5)
    want = _reference(q[:, None], keys32, values32, slots, lens, False, dim**-0.5)[:, 0]
    _assert_near_reference(out, unrounded, want, values32)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 32), (4, 4, 64), (8, 4, 24)])
def test_a_chunk_after_its_cached_prefix_reads_the_same_weights(heads: int, kv_heads: int, dim: int) -> None:
    """A cached prefix's split of the keys (the prefix whole, the chunk causally, merged by
    log-sum-exp; a decode row by paged_decode) against one causal pass: the same bfloat16
    weights per score, so only float32 noise separates them, where rounding against each
    part's own max would part them by bfloat16's."""
    flash, decode = kernels.paged_flash(), kernels.paged_decode()
    gen = torch.Generator().manual_seed(heads + dim)
    keys, values, _, _ = _pool(gen, 1024, kv_heads, dim)
    n, cached = 300, 170
    slots, lens = torch.randperm(1024, generator=gen)[:n].view(1, n), torch.tensor([n])
    q = torch.randn(1, n, heads, dim, generator=gen)
    whole, whole_lse = flash(q, keys, values, slots, lens, True, dim**-0.5)
    chunk = q[:, cached:].contiguous()
    out_a, lse_a = flash(
        chunk, keys, values, slots[:, :cached].contiguous(), torch.tensor([cached]), False, dim**-0.5
    )
    out_b, lse_b = flash(
        chunk, keys, values, slots[:, cached:].contiguous(), torch.tensor([n - cached]), True, dim**-0.5
    )
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = (lse_a - top).exp()[..., None], (lse_b - top).exp()[..., None]
    merged = (out_a * w_a + out_b * w_b) / (w_a + w_b)
    scale = values.float().abs().max()
    assert (merged - whole[:, cached:]).abs().max() < 1e-5 * scale
    last, last_lse = decode(q[:, -1].contiguous(), keys, values, slots, lens, dim**-0.5)
    assert (last - whole[:, -1]).abs().max() < 1e-5 * scale
    assert (last_lse - whole_lse[:, -1]).abs().max() < 1e-5


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
