"""The static-buffer decode step (`computed.decode_graphs`) against the eager step, bit for
bit: the same logits and the same whole KV pool, for batch sizes that fill a bucket and
ones that need padding rows, every model family, float32 and bfloat16 pools, the native
forward and the modules' one. On CPU the static path runs eagerly (what a CUDA graph
replays); the `gpu` test captures and replays graphs on CUDA."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import pytest
import torch

from computed.attention import AttentionBatch, SpanInput
from computed.decode_graphs import DecodeGraphs, batch_ladder
from computed.kv_pool import KVPool
from computed.model import load_model
from tests.computed.test_model import VARIANTS
from tests.models import TinyModels

CPU = torch.device("cpu")
BLOCK = 4
NUM_SEQS = 12
BLOCKS_PER_SEQ = 12  # 48 slots: the longest prompt (30) plus the decode steps fit
MAX_CONTEXT = 44


@pytest.fixture(params=sorted(VARIANTS))
def loaded(request: pytest.FixtureRequest, tiny_models: TinyModels):
    arch, overrides = VARIANTS[request.param]
    return load_model(tiny_models.get(arch, **overrides), CPU, torch.float32)


@contextlib.contextmanager
def modules_forward(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """Within (when `on`): the modules' forward (CUDA's), not `NativeForward`."""
    saved = model.native
    model.native = None if on else saved
    try:
        yield
    finally:
        model.native = saved


def prefilled(
    model, pool_dtype: torch.dtype, device: torch.device
) -> tuple[KVPool, list[list[int]], list[int]]:
    """A pool holding NUM_SEQS prompts of 3..30 tokens (eager prefill), their block tables
    (disjoint, shuffled ids) and context lengths."""
    c, rng = model.config, random.Random(7)
    pool = KVPool(
        c.num_layers, NUM_SEQS * BLOCKS_PER_SEQ + 1, BLOCK, c.num_kv_heads, c.head_dim, pool_dtype, device
    )
    ids = list(range(1, NUM_SEQS * BLOCKS_PER_SEQ + 1))  # block 0 unused: the warm-up's
    rng.shuffle(ids)
    tables = [ids[i * BLOCKS_PER_SEQ : (i + 1) * BLOCKS_PER_SEQ] for i in range(NUM_SEQS)]
    lens = [rng.randint(3, 30) for _ in range(NUM_SEQS)]
    spans = [SpanInput(t, 0, n) for t, n in zip(tables, lens)]
    tokens = [rng.randrange(c.vocab_size) for _ in range(sum(lens))]
    batch = AttentionBatch.build(spans, BLOCK, device)
    model(torch.tensor(tokens, device=device), batch, pool)
    return pool, tables, lens


def decode_both_ways(
    model,
    pool_dtype: torch.dtype,
    device: torch.device,
    capture: bool,
    against: str = "eager",
    exact: bool = True,
) -> None:
    """Several decode steps of 1..12 rows (padding rows in most buckets) on two copies of one
    prefilled pool: static (captured where `capture`) on one, on the other the eager step
    (`against="eager"`) or the static path uncaptured (`"static"`); logits and pools equal
    after each (bit for bit where `exact`, else the same greedy tokens and close logits)."""
    reference_pool, tables, lens = prefilled(model, pool_dtype, device)
    static_pool = KVPool(
        reference_pool.num_layers, reference_pool.num_blocks, BLOCK, reference_pool.num_kv_heads,
        reference_pool.head_dim, pool_dtype, device,
    )  # fmt: skip
    graphs = DecodeGraphs(
        model, static_pool, BLOCK, max_num_seqs=16, max_context=MAX_CONTEXT, capture=capture
    )
    uncaptured = None
    if against == "static":
        uncaptured = DecodeGraphs(model, reference_pool, BLOCK, 16, MAX_CONTEXT, capture=False)
    static_pool.kv.copy_(reference_pool.kv)  # after the capture's warm-up, which writes block 0
    assert graphs.buckets == (1, 2, 4, 8, 16)
    rng = random.Random(11)
    for num_rows in (1, 3, 2, 5, 8, 12, 7, 16 - 4):
        rows = rng.sample(range(NUM_SEQS), num_rows)
        spans = [SpanInput(tables[r], lens[r], 1) for r in rows]
        token_ids = [rng.randrange(model.config.vocab_size) for _ in rows]
        if uncaptured is None:
            batch = AttentionBatch.build(spans, BLOCK, device)
            reference = model.compute_logits(
                model(torch.tensor(token_ids, device=device), batch, reference_pool)
            )
        else:
            reference = model.compute_logits(uncaptured.run(token_ids, spans))
        hidden = graphs.run(token_ids, spans)
        assert hidden is not None, f"a decode step of {num_rows} rows is served by the static path"
        static = model.compute_logits(hidden)
        if exact:
            assert torch.equal(static, reference), f"{num_rows} rows"
            assert torch.equal(static_pool.kv, reference_pool.kv), f"{num_rows} rows"
        else:
            assert torch.equal(static.argmax(-1), reference.argmax(-1)), f"{num_rows} rows"
            torch.testing.assert_close(static, reference, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(static_pool.kv, reference_pool.kv, atol=1e-4, rtol=1e-3)
        for r in rows:
            lens[r] += 1


@pytest.mark.parametrize("forward", ["native", "modules"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_static_decode_is_the_eager_step_bit_for_bit(loaded, pool_dtype: torch.dtype, forward: str) -> None:
    with modules_forward(loaded.model, forward == "modules"):
        decode_both_ways(loaded.model, pool_dtype, CPU, capture=False)


def test_steps_outside_the_ladder_stay_eager(tiny_models: TinyModels) -> None:
    model = load_model(tiny_models.get("llama"), CPU, torch.float32).model
    c = model.config
    pool = KVPool(c.num_layers, 64, BLOCK, c.num_kv_heads, c.head_dim, torch.float32, CPU)
    graphs = DecodeGraphs(model, pool, BLOCK, max_num_seqs=4, max_context=16, capture=False)
    decode = SpanInput([1, 2, 3, 4], 10, 1)
    assert graphs.bucket_for([decode] * 3) == 4
    assert graphs.bucket_for([decode] * 5) is None  # past the top bucket
    assert graphs.bucket_for([SpanInput([1, 2, 3, 4], 16, 1)]) is None  # 17 tokens of context > 16
    assert graphs.bucket_for([SpanInput([1, 2, 3, 4], 8, 2)]) is None  # a prefill chunk
    assert graphs.bucket_for([SpanInput([1, 2, 3, 4], 10, 1, write_kv=False)]) is None  # a cached prompt
    assert graphs.run([0], [SpanInput([1, 2, 3, 4], 8, 2)]) is None
    assert not torch.any(pool.kv), "a step the static path does not serve writes nothing"
    with pytest.raises(ValueError, match="cannot hold"):
        graphs.run([0], [SpanInput([1, 2], 8, 1)])  # the 9th token needs a third block
    with pytest.raises(ValueError, match="negative block id"):
        graphs.run([0], [SpanInput([1, -2, 3], 8, 1)])
    with pytest.raises(ValueError, match="same pool slot"):
        graphs.run([0, 0], [SpanInput([1, 2, 3], 8, 1), SpanInput([4, 5, 3], 8, 1)])


def test_padding_rows_write_only_what_row_zero_writes(tiny_models: TinyModels) -> None:
    """3 rows in a bucket of 4: every block but the rows' own stays as it was (zero)."""
    model = load_model(tiny_models.get("qwen3"), CPU, torch.float32).model
    c = model.config
    pool = KVPool(c.num_layers, 32, BLOCK, c.num_kv_heads, c.head_dim, torch.float32, CPU)
    graphs = DecodeGraphs(model, pool, BLOCK, max_num_seqs=4, max_context=16, capture=False)
    spans = [SpanInput([5, 6], 4, 1), SpanInput([9], 2, 1), SpanInput([12, 13, 14], 9, 1)]
    graphs.run([1, 2, 3], spans)
    written = pool.kv.flatten(start_dim=4).ne(0).any(dim=-1)  # (layers, 2, blocks, slots in a block)
    touched = {(b, s) for b, s in (written.any(dim=0).any(dim=0)).nonzero().tolist()}
    assert touched == {(6, 0), (9, 2), (14, 1)}  # each row's new token's slot, nothing else


def test_ladder_is_nano_vllms() -> None:
    assert batch_ladder(1) == (1,)
    assert batch_ladder(6) == (1, 2, 4, 6)
    assert batch_ladder(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert batch_ladder(100) == (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_captured_graphs_replay_the_static_step_bit_for_bit(
    tiny_models: TinyModels, arch, pool_dtype
) -> None:
    """On CUDA: graphs captured per bucket and replayed give the bits of the same static
    step run eagerly (the same kernels on the same shapes)."""
    cuda = torch.device("cuda")
    model = load_model(tiny_models.get(arch), cuda, pool_dtype).model  # Triton's dtype: the pool's
    decode_both_ways(model, pool_dtype, cuda, capture=True, against="static")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_captured_graphs_match_the_eager_step(tiny_models: TinyModels, pool_dtype) -> None:
    """On CUDA against the eager step of the real rows only: cuBLAS may pick another
    algorithm for the padded row count, so the same greedy tokens and close logits (on CPU
    the products' rows do not depend on the row count: bit for bit above)."""
    cuda = torch.device("cuda")
    model = load_model(tiny_models.get("qwen3"), cuda, pool_dtype).model
    decode_both_ways(model, pool_dtype, cuda, capture=True, against="eager", exact=False)


def test_model_runner_serves_decode_steps_from_static_buffers(tiny_models: TinyModels) -> None:
    """`ModelRunner` with `decode_graphs=True` against one without: the same greedy tokens
    and the same pool, step by step, its decode steps served by the static path (a prefill
    and a step past the ladder stay eager)."""
    from computed.model_runner import ForwardInput, ModelRunner
    from computed.sequence import SamplingParams

    model = load_model(tiny_models.get("qwen2"), CPU, torch.float32).model
    c = model.config
    pools = [
        KVPool(c.num_layers, 64, BLOCK, c.num_kv_heads, c.head_dim, torch.float32, CPU) for _ in range(2)
    ]
    eager = ModelRunner(model, pools[0], BLOCK, CPU)
    static = ModelRunner(model, pools[1], BLOCK, CPU, decode_graphs=True, max_num_seqs=4, max_context=40)
    assert eager.decode_graphs is None and static.decode_graphs is not None
    pools[1].kv.zero_()
    served = []
    static.decode_graphs.run = _counting(static.decode_graphs.run, served)
    tables = [list(range(1 + 10 * i, 11 + 10 * i)) for i in range(5)]
    prompts = [[3 + i, 7, 11 + i, 2, 9][: 3 + i % 3] for i in range(5)]

    def step(runner: ModelRunner, spans: list[SpanInput], ids: list[int]) -> list[int | None]:
        rows = list(range(len(spans)))
        last = [s.num_new_tokens - 1 for s in spans] if len(spans) == 1 else rows  # prefills run alone
        params = [SamplingParams(temperature=0.0)] * len(spans)
        return runner.run(ForwardInput(ids, spans, last, rows, params, rows, len(spans)))

    lens = [len(p) for p in prompts]
    firsts = []
    for i, prompt in enumerate(prompts):  # prefills, one per step: eager on both
        got = [step(r, [SpanInput(tables[i], 0, len(prompt))], prompt) for r in (eager, static)]
        assert got[0] == got[1]
        firsts.append(got[0][0])
    tokens = firsts
    for num_rows in (3, 4, 5, 2):  # 5 rows: past the top bucket of 4, eager
        spans = [SpanInput(tables[i], lens[i], 1) for i in range(num_rows)]
        got = [step(r, spans, tokens[:num_rows]) for r in (eager, static)]
        assert got[0] == got[1] and torch.equal(pools[0].kv, pools[1].kv), f"{num_rows} rows"
        tokens = got[0] + tokens[num_rows:]
        lens = [n + 1 if i < num_rows else n for i, n in enumerate(lens)]
    # Reached for the decode steps it serves only (5 rows, past the top bucket: planned eager).
    assert [h is not None for h in served] == [True, True, True]


def _counting(run, answers: list):
    def counted(*args):
        answer = run(*args)
        answers.append(answer)
        return answer

    return counted


@pytest.mark.gpu
@needs_cuda
def test_capture_grows_the_rotary_table_first(tiny_models: TinyModels) -> None:
    """The graphs read the rotary table by address: it must already be at its full length,
    or a later eager step with a longer context would replace (and free) it."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    model = load_model(tiny_models.get("llama"), cuda, torch.float32).model
    c = model.config
    pool = KVPool(c.num_layers, 16, BLOCK, c.num_kv_heads, c.head_dim, torch.float32, cuda)
    DecodeGraphs(model, pool, BLOCK, max_num_seqs=2, max_context=16, capture=True)
    cos, _ = model.rotary._table(cuda, 1)
    assert cos.shape[0] == model.rotary.max_positions


def test_engine_streams_the_same_tokens_through_static_decode_steps(tiny_models: TinyModels) -> None:
    """Concurrent requests through the engine (decode bursts, `run_steps`), one engine's
    decode steps served by the static buffers: the same tokens as an eager engine's."""
    import asyncio

    from tests.computed.test_engine import build, generate, settle, token_ids

    prompts = [[11 + 7 * i % 300 for i in range(n)] for n in (5, 9, 14)]

    async def run(static: bool) -> tuple[list[list[int]], int]:
        engine, _ = build(tiny_models, decode_steps=4)
        runner, served = engine.runner, []
        if static:
            runner.decode_graphs = DecodeGraphs(
                runner.model, runner.pool, runner.block_size, 4, 64, capture=False
            )
            runner.decode_graphs.run = _counting(runner.decode_graphs.run, served)
        await engine.start()
        try:
            outs = await asyncio.gather(*(generate(engine, p, max_tokens=12) for p in prompts))
            await settle(engine)
        finally:
            await engine.stop(drain_seconds=1)
        return [token_ids(o) for o in outs], sum(h is not None for h in served)

    eager, _ = asyncio.run(run(static=False))
    static, num_served = asyncio.run(run(static=True))
    assert static == eager
    assert num_served >= 10, f"only {num_served} decode steps ran from the static buffers"
