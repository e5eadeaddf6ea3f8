"""The last layer run for the read rows only (`computed.output_rows`) against every layer
run for every row: bit for bit the same K/V in the pool, the read rows' logits within
float32 noise (their last attention runs the decode kernels), the native forward bit for
bit the modules' one, and a step that reads no row still writing every K/V."""

from __future__ import annotations

import itertools

import pytest
import torch

from computed.attention import AttentionBatch, SpanInput
from computed.kv_pool import KVPool
from computed.model import load_model
from computed.output_rows import OutputRows
from tests.computed.test_model import SAME, VARIANTS
from tests.computed.test_native_forward import forward_path, steps
from tests.models import TinyModels

CPU = torch.device("cpu")
BLOCK = 4


@pytest.fixture(params=sorted(VARIANTS))
def loaded(request: pytest.FixtureRequest, tiny_models: TinyModels):
    arch, overrides = VARIANTS[request.param]
    return load_model(tiny_models.get(arch, **overrides), CPU, torch.float32)


def last_rows(spans: list[SpanInput]) -> list[int]:
    return [end - 1 for end in itertools.accumulate(s.num_new_tokens for s in spans)]


def run(loaded, native: bool, read: bool) -> tuple[list[torch.Tensor], KVPool]:
    """Every step of `steps`, reading each span's last row: its logits per step, the pool."""
    model, c = loaded.model, loaded.config
    with forward_path(model, native):
        pool = KVPool(c.num_layers, 16, BLOCK, c.num_kv_heads, c.head_dim, torch.float32, CPU)
        logits = []
        for spans, ids in steps(c.vocab_size):
            batch = AttentionBatch.build(spans, BLOCK, CPU)
            rows = last_rows(spans)
            if read:
                readout = OutputRows.build(spans, rows, range(len(spans)), BLOCK, CPU)
                hidden = model(torch.tensor(ids), batch, pool, readout)
            else:
                hidden = model(torch.tensor(ids), batch, pool).index_select(0, torch.tensor(rows))
            logits.append(model.compute_logits(hidden))
        return logits, pool


@pytest.mark.parametrize("native", [True, False], ids=["native", "modules"])
def test_reading_rows_keeps_every_kv_and_the_read_logits(loaded, native: bool) -> None:
    assert loaded.model.native is not None
    read, read_pool = run(loaded, native, read=True)
    full, full_pool = run(loaded, native, read=False)
    assert torch.equal(read_pool.kv, full_pool.kv), "the last layer wrote every new token's K/V"
    for got, want in zip(read, full, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=SAME)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_native_reading_rows_is_the_modules_bit_for_bit(loaded) -> None:
    native, native_pool = run(loaded, native=True, read=True)
    modules, modules_pool = run(loaded, native=False, read=True)
    for got, want in zip(native, modules, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(native_pool.kv, modules_pool.kv)


@pytest.mark.parametrize("native", [True, False], ids=["native", "modules"])
def test_a_step_reading_no_row_still_writes_every_kv(loaded, native: bool) -> None:
    """A prefill chunk that ends before its prompt does samples nothing: no row is read,
    and the next chunk still finds all of this one's K/V, the last layer's included."""
    model, c = loaded.model, loaded.config
    with forward_path(model, native):
        ids = torch.arange(3, 13) % c.vocab_size
        spans = [SpanInput([0, 1, 2], 0, 10)]
        pools = []
        for readout in (OutputRows.build(spans, [], [], BLOCK, CPU), None):
            pool = KVPool(c.num_layers, 4, BLOCK, c.num_kv_heads, c.head_dim, torch.float32, CPU)
            hidden = model(ids, AttentionBatch.build(spans, BLOCK, CPU), pool, readout)
            assert hidden.shape == ((0 if readout else 10), c.hidden_size)
            pools.append(pool.kv)
        assert torch.equal(pools[0], pools[1])
        assert pools[0].abs().sum() > 0


def test_output_rows_span_each_read_row_alone() -> None:
    spans = [SpanInput([4, 5], 3, 4), SpanInput([6], 0, 2), SpanInput([7, 8], 5, 1)]
    readout = OutputRows.build(spans, [3, 6], [0, 2], BLOCK, CPU)
    assert readout.rows.tolist() == [3, 6]
    batch = readout.batch
    assert batch.query_lens.tolist() == [1, 1]
    assert batch.context_lens.tolist() == [7, 6]  # each row sees itself and all before it
    assert batch.positions.tolist() == [6, 5]
    assert batch.write_slots.numel() == 0, "the read batch writes nothing"
    with pytest.raises(AssertionError, match="last new token"):
        OutputRows.build(spans, [2], [0], BLOCK, CPU)
