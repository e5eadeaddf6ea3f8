"""`--dtype bfloat16` on CPU: a float32 model whose products take bfloat16 inputs, over a
bfloat16 pool (`load_model(..., products=torch.bfloat16)`, `native_bfloat16`).

What must hold: the weights are the checkpoint's rounded to bfloat16 (as loading in
bfloat16 would), every product runs natively from a bfloat16 packing, logits stay within
bfloat16's reach of transformers' float32 ones, and a prefix read back from the pool gives
the logits a one-shot forward gives (the pool holds what the miss wrote); end to end, a warm
request and one whose prefix comes back from the host tier give the cold one's tokens.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from computed import kernels
from computed.attention import AttentionBatch, SpanInput
from computed.kv_pool import KVPool
from computed.model import LoadedModel, load_model, native_bfloat16
from tests.computed.test_generation import BLOCK, Stack, _stack, prompt
from tests.computed.test_model import CPU, VARIANTS, Paged, random_prompt, reference_logits
from tests.models import TinyModels

pytestmark = pytest.mark.skipif(
    not kernels.has_compiler(), reason="needs a C++ compiler to build the native kernels"
)


@cache
def bf16_model(path: Path) -> LoadedModel:
    return load_model(path, CPU, torch.float32, products=torch.bfloat16)


def bf16_runner(loaded: LoadedModel, seed: int) -> Paged:
    runner = Paged(loaded, seed=seed)
    c = loaded.config
    runner.pool = KVPool(c.num_layers, 96, runner.block_size, c.num_kv_heads, c.head_dim, torch.bfloat16, CPU)
    return runner


@pytest.fixture(params=["llama", "qwen2", "qwen3-tied"])
def checkpoint(request: pytest.FixtureRequest, tiny_models: TinyModels) -> Path:
    arch, overrides = VARIANTS[request.param]
    return tiny_models.get(arch, **overrides)


def test_cpu_runs_bfloat16_natively() -> None:
    assert native_bfloat16(CPU), f"the native kernels did not load: {kernels.error()}"
    assert not native_bfloat16(torch.device("meta"))


def test_weights_are_rounded_and_every_product_is_packed_in_bfloat16(checkpoint: Path) -> None:
    model = bf16_model(checkpoint).model
    assert model.native is not None, "the whole forward must run natively"
    for name, weight in model.named_parameters():
        assert weight.dtype == torch.float32
        assert torch.equal(weight, weight.to(torch.bfloat16).float()), f"{name} is not a bfloat16"
    packed = [model.lm_head.packed] + [
        p for layer in model.native.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    assert all(p.dtype == torch.bfloat16 for p in packed)


def test_logits_are_nearer_float32_than_transformers_in_bfloat16(checkpoint: Path) -> None:
    """bfloat16 products with float32 sums, norms and residual stream: closer to the float32
    logits than transformers' own bfloat16 forward (which rounds every op's output)."""
    from transformers import AutoModelForCausalLM

    ids = random_prompt(41, seed=11)
    runner = bf16_runner(bf16_model(checkpoint), seed=0)
    batch = AttentionBatch.build([SpanInput(runner.allocate(len(ids)), 0, len(ids))], 4, CPU)
    logits = runner.model.compute_logits(runner.model(torch.tensor(ids), batch, runner.pool))
    want = reference_logits(checkpoint, ids)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = hf_bf16(torch.tensor([ids])).logits[0].float()
    ours_error, their_error = ((logits - want).abs().mean().item(), (theirs - want).abs().mean().item())
    assert 0 < ours_error < their_error, (
        f"mean error {ours_error} against transformers bfloat16's {their_error}"
    )


@pytest.mark.parametrize("chunks", [[7], [16], [5, 12, 3], [1] * 40], ids=["7", "16", "5-12-3", "1s"])
def test_cached_prefix_in_a_bfloat16_pool_gives_one_shot_logits(checkpoint: Path, chunks: list[int]) -> None:
    """The K/V a miss rounds into the pool is what its own attention read, and a later chunk
    reading it back takes the same bfloat16 weights for the same scores: what separates it
    from one pass is the float32 noise of merging the cached part's partial with the chunk's.
    bfloat16 rounding can turn that noise into a bfloat16 step (a value near a rounding tie),
    so: most often bit for bit (10 of these 12 cases), and inside half of bfloat16's own error
    against float32 (the worst here, qwen2 after 16 cached tokens, a third of it)."""
    ids = random_prompt(41, seed=12)
    one_shot = bf16_runner(bf16_model(checkpoint), seed=1)
    expected = one_shot.prefill(one_shot.allocate(len(ids)), ids, [])
    paged = bf16_runner(bf16_model(checkpoint), seed=2)
    got = paged.prefill(paged.allocate(len(ids)), ids, chunks)
    bf16_error = (expected - reference_logits(checkpoint, ids)[-1]).abs().mean()
    assert (got - expected).abs().mean() < bf16_error / 2, ((got - expected).abs().mean(), bf16_error)


NUM_BLOCKS = 16  # a 4-block prompt plus its decode fit; a second prompt evicts the first


@pytest.fixture(scope="module")
def bf16_stack(tmp_path_factory):
    s = _stack(
        tmp_path_factory,
        "llama",
        "--dtype",
        "bfloat16",
        "--num-blocks",
        str(NUM_BLOCKS),
        "--host-kv-memory",
        "1000000",
    )
    yield s
    assert s.computed.stop() == 0, s.computed.log()
    assert s.blockd.stop() == 0, s.blockd.log()


def test_daemon_in_bfloat16_gives_cold_tokens_warm_and_from_the_host_tier(bf16_stack: Stack) -> None:
    p = prompt(60, 4 * BLOCK + 2)
    cold, u1 = bf16_stack.generate(p, 10)
    warm, u2 = bf16_stack.generate(p, 10)
    assert (u1.cached_tokens, u2.cached_tokens) == (0, 4 * BLOCK)
    assert warm == cold
    for seed in (61, 62):  # each fills the device pool: the prefix is demoted
        bf16_stack.generate(prompt(seed, (NUM_BLOCKS - 2) * BLOCK), 4)
    again, u3 = bf16_stack.generate(p, 10)
    assert u3.host_cached_tokens == 4 * BLOCK, "the prefix did not come back from the host tier"
    assert again == cold
