"""The native CPU kernels: paged decode and paged flash against dense attention, the
linear against torch's (bit for bit past a decode step's rows, to float32 rounding and
batch-invariant within them), and their input checks."""

from __future__ import annotations

import contextlib
import platform

import pytest
import torch

from computed import kernels
from computed.model.layers import pack_weight
from computed.model.rope import RotaryEmbedding, apply_rotary

# Where a C++ compiler is installed the kernel must build; elsewhere computed falls back.
needs_compiler = pytest.mark.skipif(
    not kernels.has_compiler(), reason="needs a C++ compiler to build the kernel"
)


def _built(op):
    assert op is not None, f"the native kernels did not build here: {kernels.error()}"
    return op


@pytest.fixture(scope="module")
def paged_decode():
    return _built(kernels.paged_decode())


@needs_compiler
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [
        (8, 4, 32),
        (4, 4, 64),
        (16, 2, 128),
        (14, 2, 64),
        (6, 3, 24),
        (8, 1, 32),
        (3, 1, 32),
        (4, 2, 20),
        (12, 4, 40),
    ],
)
def test_matches_dense_attention(paged_decode, heads: int, kv_heads: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + dim)
    num_slots, items, width = 512, 5, 70
    keys = torch.randn(num_slots, kv_heads, dim, generator=gen)
    values = torch.randn(num_slots, kv_heads, dim, generator=gen)
    q = torch.randn(items, heads, dim, generator=gen)
    slots = torch.randint(0, num_slots, (items, width), generator=gen)
    lens = torch.tensor([1, 70, 33, 2, 69])
    out, lse = paged_decode(q, keys, values, slots, lens, dim**-0.5)
    for i in range(items):
        k = keys[slots[i, : lens[i]]].repeat_interleave(heads // kv_heads, dim=1)  # (L, H, D)
        v = values[slots[i, : lens[i]]].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i], k) * dim**-0.5  # (H, L)
        torch.testing.assert_close(lse[i], scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            out[i], torch.einsum("hl,lhd->hd", scores.softmax(-1), v), atol=1e-5, rtol=1e-5
        )


@needs_compiler
@pytest.mark.parametrize(
    ("slots", "lens", "message"),
    [
        ([[0, 512]], [2], "slot 512 outside the pool of 512"),
        ([[0, -1]], [2], "slot -1 outside the pool"),
        ([[0, 1]], [3], "key_lens[0] = 3 outside 1..2"),
        ([[0, 1]], [0], "key_lens[0] = 0 outside 1..2"),
    ],
)
def test_bad_slots_are_refused(paged_decode, slots, lens, message: str) -> None:
    keys = torch.zeros(512, 2, 8)
    with pytest.raises(
        RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")
    ):
        paged_decode(torch.zeros(1, 2, 8), keys, keys, torch.tensor(slots), torch.tensor(lens), 1.0)


@pytest.fixture(scope="module")
def paged_flash():
    return _built(kernels.paged_flash())


def _dense(q, k, v, causal: bool, scale: float):
    """Reference: q (Q, H, D), k/v (L, Hkv, D) -> out (Q, H, D), lse (Q, H), in float64."""
    group = q.shape[1] // k.shape[1]
    kh, vh = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,lhd->hql", q.double(), kh) * scale  # (H, Q, L)
    if causal:
        future = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    out = torch.einsum("hql,lhd->qhd", scores.softmax(-1), vh)
    return out.float(), scores.logsumexp(-1).transpose(0, 1).float()


@needs_compiler
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(8, 4, 32), (4, 4, 64), (16, 2, 128), (12, 3, 64), (6, 3, 24), (8, 1, 32), (6, 2, 40), (16, 1, 80)],
)
def test_flash_matches_dense_attention(
    paged_flash, causal: bool, heads: int, kv_heads: int, dim: int
) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + dim + causal)
    num_slots, width = 1024, 150  # keys past one 64-key block, rows past one block of positions
    lens = [150, 1, 77, 130] if not causal else [150, 1, 77, 64]
    queries = width if causal else 70
    keys = torch.randn(num_slots, kv_heads, dim, generator=gen)
    values = torch.randn(num_slots, kv_heads, dim, generator=gen)
    q = torch.randn(len(lens), queries, heads, dim, generator=gen)
    slots = torch.randint(0, num_slots, (len(lens), width), generator=gen)
    out, lse = paged_flash(q, keys, values, slots, torch.tensor(lens), causal, dim**-0.5)
    assert out.shape == (len(lens), queries, heads, dim) and lse.shape == (len(lens), queries, heads)
    for i, n in enumerate(lens):
        rows = n if causal else queries  # causal items' rows past their keys are padding
        k, v = keys[slots[i, :n]], values[slots[i, :n]]
        want_out, want_lse = _dense(q[i, :rows], k, v, causal, dim**-0.5)
        torch.testing.assert_close(out[i, :rows], want_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse[i, :rows], want_lse, atol=2e-5, rtol=2e-5)
    # Every row is written: padding rows inside a block of positions that has a real row are
    # finite, and the causal items' rows past their last such block are zero, lse -inf.
    assert torch.isfinite(out).all()
    if causal:
        per_block = max(1, 66 // (heads // kv_heads))  # paged_flash.cpp's kBlockRows / group
        for i, n in enumerate(lens):
            past = min(queries, -(-n // per_block) * per_block)
            assert past < queries or n == queries
            assert (out[i, past:] == 0).all() and (lse[i, past:] == float("-inf")).all()
            assert torch.isfinite(lse[i, :past]).all()


@needs_compiler
def test_flash_gather_keys_says_what_this_build_copies(paged_flash) -> None:
    """Keys copied at a time (computed.attention's cascade rule depends on it): 16 where the
    build has AVX-512, for a float32 pool at head sizes that are multiples of 16 up to 256,
    and AVX512_BF16 (with AVX512_BW) for a bfloat16 pool at 32, 64 and 128; else 8 where it
    has AVX2, at head sizes that are multiples of 8 up to 256; else 1. The ISA variants of
    tests/computed/test_kernel_isas.py run this too."""
    keys = _built(kernels.flash_gather_keys())
    cpu, flags = kernels._cpu_flags().split(), kernels.cflags()
    avx2 = "avx2" in cpu and platform.machine() in ("x86_64", "AMD64")
    v16 = "avx512f" in cpu and "-mno-avx512f" not in flags
    dot = v16 and {"avx512_bf16", "avx512bw"} <= set(cpu) and "-mno-avx512bf16" not in flags
    narrow = 8 if avx2 else 1
    assert [keys(d, False) for d in (16, 32, 64, 128, 256)] == [16 if v16 else narrow] * 5
    assert keys(24, False) == keys(24, True) == narrow and keys(512, False) == keys(512, True) == 1
    assert [keys(d, True) for d in (32, 64, 128)] == [16 if dot else narrow] * 3
    assert keys(16, True) == keys(48, True) == keys(256, True) == narrow


@needs_compiler
def test_flash_one_query_per_item_causal(paged_flash) -> None:
    """Qm = 1, causal: each item's only row sees key 0 alone."""
    gen = torch.Generator().manual_seed(7)
    keys, values = torch.randn(2, 64, 2, 8, generator=gen).unbind(0)
    q = torch.randn(3, 1, 4, 8, generator=gen)
    slots = torch.randint(0, 64, (3, 5), generator=gen)
    out, lse = paged_flash(q, keys, values, slots, torch.tensor([5, 1, 3]), True, 0.5)
    for i in range(3):
        want_out, want_lse = _dense(q[i], keys[slots[i, :1]], values[slots[i, :1]], True, 0.5)
        torch.testing.assert_close(out[i], want_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse[i], want_lse, atol=2e-5, rtol=2e-5)


@needs_compiler
@pytest.mark.parametrize(
    ("dim", "slots", "lens", "message"),
    [
        (8, [[0, 512]], [2], "slot 512 outside the pool of 512"),
        (8, [[0, 1]], [0], "key_lens[0] = 0 outside 1..2"),
        (12, [[0, 1]], [2], "a head size that is a multiple of 8, got 12"),
    ],
)
def test_flash_refuses_bad_inputs(paged_flash, dim: int, slots, lens, message: str) -> None:
    keys = torch.zeros(512, 2, dim)
    with pytest.raises(
        RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")
    ):
        paged_flash(
            torch.zeros(1, 3, 2, dim), keys, keys, torch.tensor(slots), torch.tensor(lens), False, 1.0
        )


def test_disabled_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(kernels.ENV, "0")
    assert kernels._load() == (False, f"{kernels.ENV}=0")


@pytest.fixture(scope="module")
def packed_linear():
    pack, op = _built(kernels.pack_linear_weight()), _built(kernels.packed_linear())
    return lambda x, weight, bias: op(x, pack(weight), bias, weight.shape[0])


def _linear_inputs(rows: int, out_features: int, in_features: int):
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    return x, weight, torch.randn(out_features, generator=gen)


@contextlib.contextmanager
def _threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 64, 97, 300])
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    [(4096, 256), (1376, 256), (256, 688), (2100, 64), (100, 64), (50, 13), (7, 5), (16, 1)],
)
def test_packed_linear_is_close_and_batch_invariant(packed_linear, rows, out_features, in_features) -> None:
    """Within float32 rounding of F.linear, and each row's result the same whatever else is
    in the batch (alone, as a step of one sequence computes it) and whatever the threads."""
    x, weight, bias = _linear_inputs(rows, out_features, in_features)
    with torch.inference_mode():  # as the model runs it
        with _threads(2):
            out = packed_linear(x, weight, bias)
        want = torch.nn.functional.linear(x.double(), weight.double(), bias.double()).float()
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
        for count in (1, 3):
            with _threads(count):
                assert torch.equal(packed_linear(x, weight, bias), out)
        for row in {0, rows // 2, rows - 1}:
            assert torch.equal(packed_linear(x[row : row + 1], weight, bias), out[row : row + 1])
        assert torch.equal(packed_linear(x[1:], weight, bias), out[1:])  # shifted off the row blocks
        assert torch.equal(packed_linear(x, weight, None) + bias, out)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 64, 97])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(4096, 256), (1376, 256), (256, 688), (50, 13), (7, 5)]
)
def test_bf16_packing_gives_the_float32_packings_products_bit_for_bit(
    rows, out_features, in_features
) -> None:
    """A weight of bfloat16 values packed at half the bytes: every product (any rows, a
    ragged last panel, with and without bias) equals the float32 packing's exactly."""
    pack, pack_bf16 = _built(kernels.pack_linear_weight()), _built(kernels.pack_linear_weight_bf16())
    op = _built(kernels.packed_linear())
    x, weight, bias = _linear_inputs(rows, out_features, in_features)
    weight = weight.to(torch.bfloat16).float()
    half, full = pack_bf16(weight), pack(weight)
    assert half.dtype == torch.int32 and half.numel() * 2 == full.numel()
    with torch.inference_mode(), _threads(2):
        for b in (bias, None):
            assert torch.equal(op(x, half, b, out_features), op(x, full, b, out_features))


def _bf16_products(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """packed_linear.cpp's bfloat16 products in torch's float32 ops: x rounded to bfloat16,
    then per output one chain over the pairs i, acc + x[2i+1] w[2i+1], then + x[2i] w[2i]
    (each product exact in float32, each add rounded), then + bias."""
    xb, wb = x.to(torch.bfloat16).float(), weight.to(torch.bfloat16).float()
    if x.shape[1] % 2:
        xb, wb = torch.nn.functional.pad(xb, (0, 1)), torch.nn.functional.pad(wb, (0, 1))
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for i in range(xb.shape[1] // 2):
        acc = acc + xb[:, 2 * i + 1, None] * wb[None, :, 2 * i + 1]
        acc = acc + xb[:, 2 * i, None] * wb[None, :, 2 * i]
    return acc if bias is None else acc + bias


@needs_compiler
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 97])
@pytest.mark.parametrize(("out_features", "in_features"), [(1376, 256), (256, 688), (50, 13), (7, 5)])
def test_bf16_products_are_the_documented_chain_bit_for_bit(rows, out_features, in_features) -> None:
    """Products in bfloat16 (`pack_linear_weight_bf16_dot`): every output is exactly the
    chain packed_linear.cpp documents (what AVX512_BF16's dot instruction computes), for any
    rows, an odd K, a ragged last panel, with or without bias, whatever the threads or the
    row's place in the batch; and within bfloat16 rounding of the float32 product."""
    pack, op = _built(kernels.pack_linear_weight_bf16_dot()), _built(kernels.packed_linear())
    x, weight, bias = _linear_inputs(rows, out_features, in_features)
    packed = pack(weight.to(torch.bfloat16))
    assert packed.dtype == torch.bfloat16 and packed.shape == (
        -(-out_features // 16),
        -(-in_features // 2),
        32,
    )
    with torch.inference_mode():
        for b in (bias, None):
            with _threads(2):
                out = op(x, packed, b, out_features)
            assert torch.equal(out, _bf16_products(x, weight, b))
            with _threads(1):
                assert torch.equal(op(x, packed, b, out_features), out)
            assert torch.equal(op(x[rows - 1 :], packed, b, out_features), out[rows - 1 :])
        exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double()).float()
        scale = x.abs().max() * weight.abs().max() * in_features
        assert (out + bias - exact).abs().max() <= scale * 2**-7  # bfloat16 inputs: 8 bits


@needs_compiler
def test_bf16_products_round_x_as_torch_does() -> None:
    """x's rounding to bfloat16 is torch's: to nearest, ties to even. (Denormals aside: the
    dot instruction reads them as zero, and an inf would meet the other columns' zeros.)"""
    pack, op = _built(kernels.pack_linear_weight_bf16_dot()), _built(kernels.packed_linear())
    one = 1.0
    ties = [one + 2**-8, one + 3 * 2**-8, -(one + 2**-8), 3.3e38, 1.5 * 2.0**-120, -7.25e-3, one + 2**-9]
    x = torch.tensor([ties])  # (1, 7)
    eye = torch.eye(7).to(torch.bfloat16)  # each output picks one column of x
    out = op(x, pack(eye), None, 7)
    assert torch.equal(out, x.to(torch.bfloat16).float())


@needs_compiler
def test_bf16_products_refuse_what_they_cannot_take() -> None:
    pack, op = _built(kernels.pack_linear_weight_bf16_dot()), _built(kernels.packed_linear())
    with pytest.raises(RuntimeError, match="takes a contiguous bfloat16 weight"):
        pack(torch.zeros(4, 8))
    with pytest.raises(RuntimeError, match="x has 8 columns, the packed weight 9 or 10"):
        op(torch.zeros(2, 8), pack(torch.zeros(16, 10, dtype=torch.bfloat16)), None, 16)


@needs_compiler
def test_bf16_packing_refuses_a_weight_that_is_not_bfloat16() -> None:
    weight = torch.ones(4, 8).to(torch.bfloat16).float()
    weight[2, 5] = 1.0 + 2.0**-10  # needs more mantissa than a bfloat16 has
    with pytest.raises(RuntimeError, match="weight value 21 is not a bfloat16"):
        _built(kernels.pack_linear_weight_bf16())(weight)


@needs_compiler
def test_pack_weight_halves_a_bfloat16_weight_only() -> None:
    """`pack_weight` picks the half-size packing exactly where it loses nothing."""
    weight = torch.randn(40, 24)
    assert pack_weight(weight).dtype == torch.float32
    assert pack_weight(weight.to(torch.bfloat16).float()).dtype == torch.int32
    assert pack_weight(weight, torch.bfloat16).dtype == torch.bfloat16  # products in bfloat16


@needs_compiler
def test_packed_linear_takes_no_rows() -> None:
    op, weight = _built(kernels.packed_linear()), torch.randn(20, 8)
    out = op(torch.zeros(0, 8), _built(kernels.pack_linear_weight())(weight), None, 20)
    assert out.shape == (0, 20)


@needs_compiler
@pytest.mark.parametrize(
    ("x", "weight", "n", "bias", "message"),
    [
        (torch.zeros(2, 8), torch.zeros(4, 7), 4, None, "x has 8 columns, the packed weight 7"),
        (torch.zeros(2, 8, dtype=torch.float64), torch.zeros(4, 8), 4, None, "contiguous float32 x"),
        (torch.zeros(8, 2).t(), torch.zeros(4, 8), 4, None, "contiguous float32 x"),
        (torch.zeros(2, 8), torch.zeros(4, 8), 17, None, "n = 17 does not fit 1 panels"),
        (
            torch.zeros(2, 8),
            torch.zeros(4, 8),
            4,
            torch.zeros(3),
            r"bias must be contiguous float32 of shape \(4,\)",
        ),
    ],
)
def test_packed_linear_refuses_bad_inputs(x, weight, n, bias, message: str) -> None:
    op, pack = _built(kernels.packed_linear()), _built(kernels.pack_linear_weight())
    with pytest.raises(RuntimeError, match=message):
        op(x, pack(weight), bias, n)
    with pytest.raises(RuntimeError, match="a weight from pack_linear_weight"):
        op(torch.zeros(2, 8), torch.zeros(8, 4), None, 4)
    with pytest.raises(RuntimeError, match="contiguous float32 weight"):
        pack(torch.zeros(4, 8, dtype=torch.float64))


@pytest.fixture(scope="module")
def rms_norm():
    return _built(kernels.rms_norm())


@needs_compiler
@pytest.mark.parametrize("shape", [(1, 256), (8, 256), (16, 13), (3, 8, 32), (5, 1), (1000, 200)])
def test_rms_norm_matches_torch(rms_norm, shape) -> None:
    from computed.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * 3
    norm = RMSNorm(shape[-1], 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen))
    x64 = x.double()
    want = norm.weight.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = rms_norm(x, norm.weight, 1e-6)
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
    with torch.inference_mode():  # the module takes the op
        assert torch.equal(norm(x), got)
    assert torch.equal(rms_norm(x[:1], norm.weight, 1e-6), got[:1])  # a row alone: the same


@needs_compiler
def test_rms_norm_refuses_bad_inputs(rms_norm) -> None:
    with pytest.raises(RuntimeError, match=r"weight must be contiguous of shape \(8,\)"):
        rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(8), 1e-6)


@needs_compiler
@pytest.mark.parametrize("shape", [(1, 256), (64, 256), (16, 13), (1100, 200)])
def test_add_rms_norm_is_the_add_then_the_norm(rms_norm, shape) -> None:
    """Bit for bit `x + residual` (torch's add) and `rms_norm` of it."""
    op = _built(kernels.add_rms_norm())
    gen = torch.Generator().manual_seed(sum(shape))
    x, residual = torch.randn(2, *shape, generator=gen).unbind(0)
    weight = torch.randn(shape[-1], generator=gen)
    y, total = op(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)
    assert torch.equal(y, rms_norm(x + residual, weight, 1e-5))
    with pytest.raises(RuntimeError, match="residual shaped like x"):
        op(x, residual[:, :-1].contiguous(), weight, 1e-5)


@pytest.fixture(scope="module")
def rotary():
    return _built(kernels.rotary())


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "dim"), [(1, 8, 4, 32), (7, 4, 1, 8), (300, 6, 2, 128)]
)
def test_rotary_is_bit_identical_to_torch(rotary, threads, tokens, heads, kv_heads, dim) -> None:
    """Three roundings (two products, a sum) as torch's separate kernels: equal, not close.
    q is a strided view (q/k/v of one product), as a fused projection would hand it over."""
    gen = torch.Generator().manual_seed(tokens * heads + dim)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen) * 3
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads].contiguous()
    table = RotaryEmbedding(dim, 10000.0, 4096)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    cos, sin = table.cos_sin(positions, int(positions.max()), torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            q_out, k_out = rotary(q, k, cos, sin)
        assert torch.equal(q_out, apply_rotary(q, cos, sin))
        assert torch.equal(k_out, apply_rotary(k, cos, sin))
    finally:
        torch.set_num_threads(before)


@needs_compiler
def test_rotary_refuses_mismatched_shapes(rotary) -> None:
    cos = torch.zeros(3, 8)
    with pytest.raises(RuntimeError, match=r"q \(T, heads, D\) disagrees with cos"):
        rotary(torch.zeros(3, 2, 6), torch.zeros(3, 1, 8), cos, cos)
    with pytest.raises(RuntimeError, match="sin must be contiguous float32 shaped like cos"):
        rotary(torch.zeros(3, 2, 8), torch.zeros(3, 1, 8), cos, torch.zeros(3, 4))


@pytest.fixture(scope="module")
def merge_partials():
    return _built(kernels.merge_partials())


@needs_compiler
@pytest.mark.parametrize(("heads", "dim"), [(8, 32), (3, 20)])
def test_merge_partials_matches_torch_merge(merge_partials, heads: int, dim: int) -> None:
    from computed.attention import _merge

    gen = torch.Generator().manual_seed(heads * 100 + dim)
    sizes = [5, 9, 4]  # three tiles' whole results, padding rows included
    outs = [torch.randn(n, heads, dim, generator=gen) for n in sizes]
    lses = [torch.randn(n, heads, generator=gen) * 4 for n in sizes]
    total = sum(sizes)
    # Row r's partials among the 18 rows concatenated; 18 = no partial (the sentinel).
    index = torch.tensor([[0, 5, 14], [1, total, total], [13, 6, total], [total, 17, 2], [8, 9, 10]])
    out = merge_partials(outs, lses, index)
    torch.testing.assert_close(out, _merge(outs, lses, index), atol=1e-6, rtol=1e-5)
    # A single partial is passed through; weights follow the log-sum-exps.
    torch.testing.assert_close(out[1], outs[0][1])
    big = [lse.clone() for lse in lses]
    big[0][0] += 60.0  # row 0's first partial dominates every head
    torch.testing.assert_close(merge_partials(outs, big, index)[0], outs[0][0], atol=1e-6, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize(
    ("index", "message"),
    [
        ([[0, 9]], "index entry 9 outside 0..8"),
        ([[-1, 0]], "index entry -1 outside"),
    ],
)
def test_merge_partials_rejects_bad_index(merge_partials, index, message: str) -> None:
    outs, lses = [torch.randn(8, 2, 8)], [torch.randn(8, 2)]
    with pytest.raises(RuntimeError, match=message):
        merge_partials(outs, lses, torch.tensor(index))


@needs_compiler
def test_merge_partials_rejects_mismatched_tiles(merge_partials) -> None:
    index = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="lse tile 0 must be"):
        merge_partials([torch.randn(4, 2, 8)], [torch.randn(3, 2)], index)
    with pytest.raises(RuntimeError, match="output tile 1 must be"):
        merge_partials(
            [torch.randn(4, 2, 8), torch.randn(4, 3, 8)], [torch.randn(4, 2), torch.randn(4, 3)], index
        )


@needs_compiler
@pytest.mark.parametrize(("rows", "width"), [(1, 688), (64, 688), (3, 13), (17, 8)])
def test_silu_mul_matches_torch(rows: int, width: int) -> None:
    op = _built(kernels.silu_mul())
    gen = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, 2 * width, generator=gen) * 6
    x[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 0.0])  # past e^x's float32 range both ways
    gate, up = x.split(width, dim=-1)
    torch.testing.assert_close(op(x), torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=1e-6)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 64, 97])
@pytest.mark.parametrize(("width", "in_features"), [(688, 256), (16, 688), (48, 5)])
@pytest.mark.parametrize("packing", ["float32", "bf16", "bf16 products"])
def test_packed_linear_swiglu_is_the_two_ops_bit_for_bit(rows, width, in_features, packing) -> None:
    """The product's epilogue applies silu(gate) * up: exactly silu_mul of packed_linear's
    (M, 2I) product, for any packing, whatever rows (full and remainder row blocks),
    the threads, or the row's place in the batch."""
    op = _built(kernels.packed_linear_swiglu())
    product, silu_mul = _built(kernels.packed_linear()), _built(kernels.silu_mul())
    x, weight, _ = _linear_inputs(rows, 2 * width, in_features)
    x = x * 3  # gates well past silu's knee both ways
    if packing != "float32":
        weight = weight.to(torch.bfloat16).float()
    packed = pack_weight(weight, torch.bfloat16 if packing == "bf16 products" else torch.float32)
    assert (
        packed.dtype
        == {"float32": torch.float32, "bf16": torch.int32, "bf16 products": torch.bfloat16}[packing]
    )
    with torch.inference_mode():
        with _threads(2):
            out = op(x, packed, 2 * width)
            assert torch.equal(out, silu_mul(product(x, packed, None, 2 * width)))
        with _threads(1):
            assert torch.equal(op(x, packed, 2 * width), out)
        assert torch.equal(op(x[rows - 1 :], packed, 2 * width), out[rows - 1 :])
    if packing == "bf16 products":
        x = x.to(torch.bfloat16).float()  # what the products take; their sums differ by float32 rounding
    gate, up = torch.nn.functional.linear(x.double(), weight.double()).split(width, dim=-1)
    torch.testing.assert_close(out, (torch.nn.functional.silu(gate) * up).float(), atol=1e-4, rtol=1e-5)


@needs_compiler
def test_packed_linear_swiglu_refuses_widths_off_the_panels() -> None:
    op = _built(kernels.packed_linear_swiglu())
    pack = _built(kernels.pack_linear_weight())
    with pytest.raises(RuntimeError, match=r"each a multiple of 16, as the weight's n; got n = 40"):
        op(torch.zeros(2, 8), pack(torch.zeros(40, 8)), 40)  # a gate of 20 rows
    with pytest.raises(RuntimeError, match="got n = 16 for 1 panels"):
        op(torch.zeros(2, 8), pack(torch.zeros(16, 8)), 16)  # one panel: no pair
    with pytest.raises(RuntimeError, match="x has 8 columns, the packed weight 7"):
        op(torch.zeros(2, 8), pack(torch.zeros(32, 7)), 32)


@needs_compiler
def test_silu_mul_rejects_odd_or_strided_input() -> None:
    op = _built(kernels.silu_mul())
    with pytest.raises(RuntimeError, match="even number of columns"):
        op(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        op(torch.randn(8, 4).t())


@needs_compiler
@pytest.mark.parametrize(("rows", "width"), [(1, 1), (3, 7), (64, 4096), (5, 8), (9, 37), (2, 16)])
def test_argmax_rows_is_torch_argmax(rows: int, width: int) -> None:
    """The same index as torch.argmax: the first of tied maxima (in a vector lane, across
    lanes and in the tail), the first NaN where a row has one, 0 for a row of -inf."""
    op = _built(kernels.argmax_rows())
    gen = torch.Generator().manual_seed(rows * width)
    x = torch.randint(-3, 3, (rows, width), generator=gen).float()  # many ties
    want = x.argmax(dim=-1)
    assert torch.equal(op(x), want)
    y = torch.randn(rows, width, generator=gen)
    assert torch.equal(op(y), y.argmax(dim=-1))
    if width > 2:
        z = y.clone()
        z[0, width - 1] = float("nan")  # the tail or the last lane
        z[-1, 1] = float("nan")
        z[-1, width - 1] = float("nan")
        assert torch.equal(op(z), z.argmax(dim=-1))
    ninf = torch.full((rows, width), float("-inf"))
    assert torch.equal(op(ninf), ninf.argmax(dim=-1))


@needs_compiler
def test_argmax_rows_refuses_bad_input() -> None:
    op = _built(kernels.argmax_rows())
    with pytest.raises(RuntimeError, match="contiguous float32"):
        op(torch.randn(8, 4).t())
    with pytest.raises(RuntimeError, match="V >= 1"):
        op(torch.randn(3, 0))


@needs_compiler
@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_write_kv_is_index_copy(tokens: int) -> None:
    """Rows of k and of a strided v (a column block of the fused product) land in their
    slots as two index_copy_ calls put them; other slots keep their values."""
    op = _built(kernels.write_kv())
    gen = torch.Generator().manual_seed(tokens)
    keys, values = torch.randn(2, 512, 4, 8, generator=gen).unbind(0)
    qkv = torch.randn(tokens, 96, generator=gen)
    k, v = qkv[:, 32:64].view(tokens, 4, 8), qkv[:, 64:].view(tokens, 4, 8)
    slots = torch.randperm(512, generator=gen)[:tokens]
    want_k, want_v = keys.clone().index_copy_(0, slots, k), values.clone().index_copy_(0, slots, v)
    op(keys, values, k, v, slots)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)


@needs_compiler
def test_write_kv_refuses_bad_slots_and_shapes() -> None:
    op = _built(kernels.write_kv())
    keys, values = torch.zeros(2, 16, 2, 8).unbind(0)
    k = torch.ones(3, 2, 8)
    with pytest.raises(RuntimeError, match="outside the pool of 16"):
        op(keys, values, k, k, torch.tensor([0, 16, 1]))
    with pytest.raises(RuntimeError, match="slots must be contiguous int64"):
        op(keys, values, k, k, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="shaped like the pool's rows"):
        op(keys, values, torch.ones(3, 2, 4), torch.ones(3, 2, 4), torch.tensor([0, 1, 2]))
    assert not keys.any()  # nothing written by a refused call
