"""`NativeForward` (the CPU float32 forward over plain tensors) against the modules' own
forward: the same ops in the same order, so bit for bit the same hidden states, logits
and pool contents, for every model family and every kind of step (prefill, decode,
cascaded shared prefixes, a fully cached prompt that writes nothing); and the whole step
in one op (`kvcache::forward_layers`) against the layer loop it replaces."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
from collections.abc import Iterator

import pytest
import torch

from computed import kernels
from computed.attention import AttentionBatch, SpanInput
from computed.kv_pool import KVPool
from computed.model import load_model
from computed.output_rows import OutputRows
from tests.computed.test_model import VARIANTS
from tests.models import TinyModels

CPU = torch.device("cpu")
BLOCK = 4

pytestmark = pytest.mark.skipif(
    kernels.packed_linear() is None, reason=f"no native kernels: {kernels.error()}"
)


@pytest.fixture(params=sorted(VARIANTS))
def loaded(request: pytest.FixtureRequest, tiny_models: TinyModels):
    arch, overrides = VARIANTS[request.param]
    return load_model(tiny_models.get(arch, **overrides), CPU, torch.float32)


def steps(vocab: int) -> list[tuple[list[SpanInput], list[int]]]:
    """A prefill of two prompts sharing 8 tokens (cascaded), a decode step of both plus a
    third prompt's chunk, and a fully cached prompt recomputing its last token."""
    rng = random.Random(5)
    shared = [rng.randrange(vocab) for _ in range(8)]
    a, b = (
        shared + [rng.randrange(vocab) for _ in range(5)],
        shared + [rng.randrange(vocab) for _ in range(3)],
    )
    c = [rng.randrange(vocab) for _ in range(10)]
    ta, tb, tc = [0, 1, 2, 3, 4], [0, 1, 5, 6], [7, 8, 9]
    return [
        ([SpanInput(ta, 0, len(a))], a),
        ([SpanInput(tb, 8, len(b) - 8)], b[8:]),  # reads a's first two blocks
        (
            [SpanInput(ta, len(a), 1), SpanInput(tb, len(b), 1), SpanInput(tc, 0, 6)],
            [rng.randrange(vocab), rng.randrange(vocab), *c[:6]],
        ),
        ([SpanInput(ta[:2], 7, 1, write_kv=False)], [a[7]]),
        (
            [SpanInput(ta, len(a) + 1, 1), SpanInput(tb, len(b) + 1, 1)],
            [rng.randrange(vocab), rng.randrange(vocab)],
        ),
    ]


@contextlib.contextmanager
def forward_path(model: torch.nn.Module, native: bool) -> Iterator[None]:
    """Within: the model runs its native forward (`native`) or its modules' one."""
    saved = model.native
    model.native = saved if native else None
    try:
        yield
    finally:
        model.native = saved


@contextlib.contextmanager
def layer_loop(model: torch.nn.Module) -> Iterator[None]:
    """Within: the native forward runs its layer loop, not `kvcache::forward_layers`."""
    saved = model.native
    model.native = dataclasses.replace(saved, whole=None)
    try:
        yield
    finally:
        model.native = saved


def run(loaded, native: bool, pool_dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], KVPool]:
    model, c = loaded.model, loaded.config
    with forward_path(model, native):
        pool = KVPool(c.num_layers, 16, BLOCK, c.num_kv_heads, c.head_dim, pool_dtype, CPU)
        outs = []
        for spans, ids in steps(c.vocab_size):
            # the default cascade rule: every shared run is cascaded, merges included.
            batch = AttentionBatch.build(spans, BLOCK, CPU)
            hidden = model(torch.tensor(ids), batch, pool)
            outs += [hidden, model.compute_logits(hidden[batch.last_token_index])]
        return outs, pool


def test_native_forward_is_the_modules_forward_bit_for_bit(loaded) -> None:
    assert loaded.model.native is not None, "the loader packs the products: the native forward is built"
    native, native_pool = run(loaded, native=True)
    modules, modules_pool = run(loaded, native=False)
    assert len(native) == len(modules)
    for got, want in zip(native, modules, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(native_pool.kv, modules_pool.kv)


def test_native_forward_needs_every_product_packed(loaded) -> None:
    """An unpacked product (here the vocabulary projection) leaves the modules' forward."""
    from computed.model.native import NativeForward

    model = loaded.model
    packed = model.lm_head.packed
    model.lm_head.packed = None
    try:
        assert NativeForward.build(model) is None
    finally:
        model.lm_head.packed = packed
    assert NativeForward.build(model) is not None


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_whole_step_op_is_the_layer_loop_bit_for_bit(loaded, pool_dtype: torch.dtype) -> None:
    """Every step kind (decode tiles, causal chunks, cascaded segments merged, rows placed)
    through `kvcache::forward_layers` and through the loop of layer ops and `attend`."""
    assert loaded.model.native.whole is not None, "every variant's shapes take the one-op step"
    whole, whole_pool = run(loaded, native=True, pool_dtype=pool_dtype)
    with layer_loop(loaded.model):
        looped, looped_pool = run(loaded, native=True, pool_dtype=pool_dtype)
    for got, want in zip(whole, looped, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(whole_pool.kv, looped_pool.kv)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_whole_step_op_reads_the_sampled_rows_as_the_layer_loop_does(loaded, pool_dtype: torch.dtype) -> None:
    """Steps whose last layer runs for each span's last row only (`OutputRows`, a prefill
    step's sampled rows): through `kvcache::forward_layers`' read rows and through the loop."""
    assert loaded.model.native.whole is not None, "every variant's shapes take the one-op step"

    def run_read() -> tuple[list[torch.Tensor], KVPool]:
        model, c = loaded.model, loaded.config
        pool = KVPool(c.num_layers, 16, BLOCK, c.num_kv_heads, c.head_dim, pool_dtype, CPU)
        outs = []
        for spans, ids in steps(c.vocab_size):
            batch = AttentionBatch.build(spans, BLOCK, CPU)
            ends = list(itertools.accumulate(s.num_new_tokens for s in spans))
            read = OutputRows.build(spans, [e - 1 for e in ends], list(range(len(spans))), BLOCK, CPU)
            hidden = model(torch.tensor(ids), batch, pool, read)  # (S, hidden)
            assert hidden.shape[0] == len(spans)
            outs += [hidden, model.compute_logits(hidden)]
        return outs, pool

    whole, whole_pool = run_read()
    with layer_loop(loaded.model):
        looped, looped_pool = run_read()
    for got, want in zip(whole, looped, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(whole_pool.kv, looped_pool.kv)
