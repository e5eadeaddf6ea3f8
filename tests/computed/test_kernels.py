"""The native paged decode kernel against dense attention, and its input checks."""

from __future__ import annotations

import pytest
import torch

from computed import kernels

# Where a C++ compiler is installed the kernel must build; elsewhere computed falls back.
needs_compiler = pytest.mark.skipif(
    not kernels.has_compiler(), reason="needs a C++ compiler to build the kernel"
)


@pytest.fixture(scope="module")
def paged_decode():
    op = kernels.paged_decode()
    assert op is not None, f"the native decode kernel did not build here: {kernels.error()}"
    return op


@needs_compiler
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(8, 4, 32), (4, 4, 64), (16, 2, 128), (6, 3, 24), (8, 1, 32)]
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


def test_disabled_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(kernels.ENV, "0")
    assert kernels._load() == (None, f"{kernels.ENV}=0")
