"""The model layer against Hugging Face transformers on the same tiny random weights.

Prefix caching is only correct if reading a prefix's K/V from the paged pool gives the
very logits a one-shot forward gives, so every paged path here is compared with a
one-shot forward and with transformers (fp32, CPU).
"""

from __future__ import annotations

import json
import random
import shutil
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from computed.attention import AttentionBatch, SpanInput, paged_attention
from computed.kv_pool import KVPool
from computed.model import CheckpointError, LoadedModel, ModelConfig, UnsupportedModelError, load_model
from tests.models import LLAMA3_ROPE_SCALING, TinyModels

VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-rope-llama3": ("llama", {"rope_scaling": LLAMA3_ROPE_SCALING}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
}
TOLERANCE = 1e-4  # vs transformers (fp32)
SAME = 5e-5  # paged vs one-shot through our own model (logits up to ~11: float32 noise)
CPU = torch.device("cpu")


@pytest.fixture(params=sorted(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tiny_models: TinyModels) -> Path:
    arch, overrides = VARIANTS[request.param]
    return tiny_models.get(arch, **overrides)


@cache
def ours(path: Path) -> LoadedModel:
    return load_model(path, CPU, torch.float32)


@cache
def reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) logits of transformers' one-shot forward."""
    return _reference_logits(path, tuple(ids)).clone()


@cache
def _reference_logits(path: Path, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return reference(path)(torch.tensor([ids])).logits[0].float()


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 400) for _ in range(length)]


class Paged:
    """A minimal engine: a pool, shuffled free block ids, one forward per `step`."""

    def __init__(self, loaded: LoadedModel, block_size: int = 4, num_blocks: int = 96, seed: int = 0) -> None:
        c = loaded.config
        self.model, self.block_size = loaded.model, block_size
        self.pool = KVPool(
            c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, torch.float32, CPU
        )
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous, unordered block tables

    def allocate(self, num_tokens: int) -> list[int]:
        num_blocks = -(-num_tokens // self.block_size)
        table, self.free = self.free[:num_blocks], self.free[num_blocks:]
        return table

    def step(self, spans: list[SpanInput], ids: list[list[int]]) -> torch.Tensor:
        """Logits (S, vocab) of each span's last new token."""
        batch = AttentionBatch.build(spans, self.block_size, CPU)
        flat = torch.tensor([t for chunk in ids for t in chunk])
        hidden = self.model(flat, batch, self.pool)
        return self.model.compute_logits(hidden[batch.last_token_index])

    def prefill(self, table: list[int], ids: list[int], chunks: list[int]) -> torch.Tensor:
        """Run `ids` in chunks of the given sizes, then the rest; logits of the last token."""
        bounds, start = [], 0
        for size in chunks:
            if start + size >= len(ids):
                break
            bounds.append((start, start + size))
            start += size
        bounds.append((start, len(ids)))
        for start, end in bounds:
            logits = self.step([SpanInput(table, start, end - start)], [ids[start:end]])
        return logits[0]


# ---- logits against transformers ------------------------------------------------------------


def test_all_positions_match_transformers(checkpoint: Path) -> None:
    ids = random_prompt(41, seed=1)
    runner = Paged(ours(checkpoint))
    batch = AttentionBatch.build([SpanInput(runner.allocate(len(ids)), 0, len(ids))], 4, CPU)
    hidden = runner.model(torch.tensor(ids), batch, runner.pool)
    logits = runner.model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (41, ours(checkpoint).config.vocab_size)
    torch.testing.assert_close(logits, reference_logits(checkpoint, ids), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("chunks", [[7], [16], [5, 12, 3], [1] * 40], ids=["7", "16", "5-12-3", "1s"])
def test_cached_prefix_gives_one_shot_logits(checkpoint: Path, chunks: list[int]) -> None:
    """A prefix read back from the pool (any split, block-aligned or not) changes nothing."""
    ids = random_prompt(41, seed=2)
    one_shot = Paged(ours(checkpoint), seed=1)
    expected = one_shot.prefill(one_shot.allocate(len(ids)), ids, [])
    paged = Paged(ours(checkpoint), seed=2)
    got = paged.prefill(paged.allocate(len(ids)), ids, chunks)
    torch.testing.assert_close(got, expected, atol=SAME, rtol=0)
    torch.testing.assert_close(got, reference_logits(checkpoint, ids)[-1], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize(
    "variant, block_size", [*((v, 4) for v in sorted(VARIANTS)), ("qwen3", 16), ("llama-rope-llama3", 16)]
)
def test_batched_greedy_decode_equals_generate(
    tiny_models: TinyModels, variant: str, block_size: int
) -> None:
    """Prefill three prompts in one forward, then decode them together, token for token."""
    from transformers import GenerationConfig

    arch, overrides = VARIANTS[variant]
    checkpoint = tiny_models.get(arch, **overrides)
    loaded, max_new = ours(checkpoint), 12
    prompts = [random_prompt(n, seed=n) for n in (5, 17, 30)]
    runner = Paged(loaded, block_size=block_size, seed=block_size)
    tables = [runner.allocate(len(p) + max_new) for p in prompts]
    logits = runner.step([SpanInput(t, 0, len(p)) for t, p in zip(tables, prompts)], prompts)
    outputs = [[int(row.argmax())] for row in logits]
    for _ in range(max_new - 1):
        live = [i for i, out in enumerate(outputs) if out[-1] not in loaded.config.eos_token_ids]
        if not live:
            break
        spans = [SpanInput(tables[i], len(prompts[i]) + len(outputs[i]) - 1, 1) for i in live]
        logits = runner.step(spans, [[outputs[i][-1]] for i in live])
        for i, row in zip(live, logits):
            outputs[i].append(int(row.argmax()))

    hf = reference(checkpoint)
    greedy = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=list(loaded.config.eos_token_ids),
        pad_token_id=0,
    )
    for prompt, got in zip(prompts, outputs):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                generation_config=greedy,
            )[0, len(prompt) :].tolist()
        assert got == expected


def test_mixed_batch_equals_sequences_one_by_one(checkpoint: Path) -> None:
    """A cached prompt's no-write recompute, a fresh prefill, a prefill after a cached
    prefix and decodes share one forward and each gets the logits it gets alone."""
    loaded = ours(checkpoint)
    prompts = [random_prompt(n, seed=10 + n) for n in (12, 9, 23, 14, 6)]
    # Sequence i has `cached[i]` tokens in the pool, then `new[i]` tokens this step.
    cached, new, write = [12, 0, 13, 13, 5], [1, 9, 10, 1, 1], [False, True, True, True, True]
    done = [c - (not w) for c, w in zip(cached, write)]  # the no-write one recomputes its last token
    fed = [p[d : d + n] for p, d, n in zip(prompts, done, new)]

    def span(i: int, table: list[int]) -> SpanInput:
        return SpanInput(table, done[i], new[i], write[i])

    alone: list[torch.Tensor] = []
    for i, prompt in enumerate(prompts):
        runner = Paged(loaded, seed=3)
        table = runner.allocate(len(prompt))
        if cached[i]:
            runner.prefill(table, prompt[: cached[i]], [])
        alone.append(runner.step([span(i, table)], [fed[i]])[0])

    runner = Paged(loaded, seed=4)
    tables = [runner.allocate(len(p)) for p in prompts]
    for table, prompt, count in zip(tables, prompts, cached):
        if count:
            runner.prefill(table, prompt[:count], [])
    together = runner.step([span(i, t) for i, t in enumerate(tables)], fed)
    torch.testing.assert_close(together, torch.stack(alone), atol=SAME, rtol=0)


def test_fully_cached_prompt_recomputes_last_position_without_writing(checkpoint: Path) -> None:
    loaded = ours(checkpoint)
    ids = random_prompt(16, seed=5)  # 4 full blocks of 4: all of it is cacheable
    runner = Paged(loaded, seed=5)
    table = runner.allocate(len(ids))
    expected = runner.prefill(table, ids, [])
    before = runner.pool.kv.clone()

    hit = SpanInput(table, num_computed_tokens=15, num_new_tokens=1, write_kv=False)
    assert AttentionBatch.build([hit], 4, CPU).write_slots.numel() == 0
    torch.testing.assert_close(runner.step([hit], [ids[-1:]])[0], expected, atol=SAME, rtol=0)
    assert torch.equal(runner.pool.kv, before)
    # Another token at that position would have other K/V: it must not land in the shared block.
    runner.step([hit], [[(ids[-1] + 1) % 400]])
    assert torch.equal(runner.pool.kv, before)
    # ...whereas a writing step does change the pool (the check above can fail).
    runner.step([SpanInput(table, 15, 1)], [[(ids[-1] + 1) % 400]])
    assert not torch.equal(runner.pool.kv, before)


def test_logits_in_bfloat16_stay_close(tiny_models: TinyModels) -> None:
    path = tiny_models.get("qwen3")
    ids = random_prompt(20, seed=6)
    loaded = load_model(path, CPU, torch.bfloat16)
    c = loaded.config
    pool = KVPool(c.num_layers, 8, 4, c.num_kv_heads, c.head_dim, torch.bfloat16, CPU)
    batch = AttentionBatch.build([SpanInput(list(range(5)), 0, 20)], 4, CPU)
    hidden = loaded.model(torch.tensor(ids), batch, pool)
    assert hidden.dtype == torch.bfloat16
    logits = loaded.model.compute_logits(hidden[batch.last_token_index])[0]
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference_logits(path, ids)[-1], atol=0.25, rtol=0.05)


# ---- paged attention in isolation ---------------------------------------------------------


def assert_matches_dense_attention(out, q, keys, values, cached, lengths, kv_heads) -> None:
    """Each sequence's new queries against its whole context, causal, computed densely."""
    heads, dim = q.shape[1], q.shape[2]
    start = 0
    for k, v, c, n in zip(keys, values, cached, lengths):
        qs = q[start : start + n - c].transpose(0, 1)  # (H, Lq, D)
        kk = k.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # (H, n, D)
        vv = v.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        scores = qs @ kk.transpose(1, 2) * dim**-0.5
        visible = torch.arange(n)[None, :] <= torch.arange(c, n)[:, None]
        expected = (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vv).transpose(0, 1)
        torch.testing.assert_close(out[start : start + n - c], expected, atol=1e-5, rtol=0)
        start += n - c


def test_paged_attention_matches_dense_causal_attention() -> None:
    """Two sequences with cached prefixes, GQA, shuffled blocks vs a dense reference."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 6, 2, 8, 4
    pool = KVPool(1, 16, block, kv_heads, dim, torch.float32, CPU)
    lengths, cached = [11, 6], [7, 0]
    keys = [torch.randn(n, kv_heads, dim) for n in lengths]
    values = [torch.randn(n, kv_heads, dim) for n in lengths]
    tables = [[9, 2, 14], [5, 0]]
    for table, k, v, n in zip(tables, keys, values, cached):
        for pos in range(n):  # the cached prefix, written by hand
            pool.key(0)[table[pos // block], pos % block] = k[pos]
            pool.value(0)[table[pos // block], pos % block] = v[pos]
    batch = AttentionBatch.build(
        [SpanInput(t, c, n - c) for t, c, n in zip(tables, cached, lengths)], block, CPU
    )
    q = torch.randn(batch.num_tokens, heads, dim)
    k_new = torch.cat([k[c:] for k, c in zip(keys, cached)])
    v_new = torch.cat([v[c:] for v, c in zip(values, cached)])
    out = paged_attention(q, k_new, v_new, 0, batch, pool, scale=dim**-0.5)

    assert_matches_dense_attention(out, q, keys, values, cached, lengths, kv_heads)


def test_build_lays_out_slots_positions_and_last_tokens() -> None:
    batch = AttentionBatch.build(
        [
            SpanInput([7, 3, 12], num_computed_tokens=8, num_new_tokens=2),
            SpanInput([5, 9], num_computed_tokens=5, num_new_tokens=1),
            SpanInput([4, 6], num_computed_tokens=5, num_new_tokens=2, write_kv=[False, True]),
        ],
        block_size=4,
        device=CPU,
    )
    assert batch.positions.tolist() == [8, 9, 5, 5, 6]
    assert batch.write_slots.tolist() == [12 * 4 + 0, 12 * 4 + 1, 9 * 4 + 1, 6 * 4 + 2]
    assert batch.write_token_index.tolist() == [0, 1, 2, 4]
    assert batch.last_token_index.tolist() == [1, 2, 4]
    assert [(s.query_start, s.query_len, s.context_len) for s in batch.spans] == [
        (0, 2, 10),
        (2, 1, 6),
        (3, 2, 7),
    ]
    assert [s.block_table.tolist() for s in batch.spans] == [[7, 3, 12], [5, 9], [4, 6]]
    assert batch.max_position == 9


@pytest.mark.parametrize(
    "span, message",
    [
        (SpanInput([1], 3, 2), "cannot hold 5 tokens"),
        (SpanInput([1, 2], 0, 0), "at least one new token"),
        (SpanInput([1, 2], -1, 2), "num_computed_tokens"),
        (SpanInput([1, 2], 0, 3, write_kv=[True]), "1 flags for 3"),
        (SpanInput([1, -2], 0, 6), "negative block id"),
    ],
)
def test_build_rejects_bad_spans(span: SpanInput, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AttentionBatch.build([span], 4, CPU)


def test_build_rejects_two_writers_of_one_slot() -> None:
    with pytest.raises(ValueError, match="same pool slot"):
        AttentionBatch.build([SpanInput([3], 0, 2), SpanInput([3], 0, 2)], 4, CPU)


def test_position_past_the_model_limit_is_refused(tiny_models: TinyModels) -> None:
    loaded = load_model(tiny_models.get("llama", max_position_embeddings=16), CPU, torch.float32)
    runner = Paged(loaded)
    with pytest.raises(ValueError, match="position 16"):
        runner.step([SpanInput(runner.allocate(17), 16, 1)], [[5]])


# ---- KV pool --------------------------------------------------------------------------------


def test_pool_is_one_tensor_with_per_layer_views() -> None:
    pool = KVPool(3, 10, 4, 2, 8, torch.float32, CPU)
    assert pool.kv.shape == (3, 2, 10, 4, 2, 8)
    pool.key(1)[7, 2] = 1.0
    pool.value(2)[0, 0] = 2.0
    assert pool.kv[1, 0, 7, 2].eq(1).all() and pool.kv[2, 1, 0, 0].eq(2).all()
    assert pool.key(1).data_ptr() != pool.value(1).data_ptr()
    assert pool.key(0).untyped_storage().data_ptr() == pool.kv.untyped_storage().data_ptr()
    assert pool.num_bytes == 3 * 2 * 10 * 4 * 2 * 8 * 4


def test_pool_sizing() -> None:
    per_block = KVPool.bytes_per_block(2, 16, 4, 64, torch.bfloat16)
    assert per_block == 2 * 2 * 16 * 4 * 64 * 2
    assert KVPool.num_blocks_for_budget(10 * per_block + per_block - 1, 2, 16, 4, 64, torch.bfloat16) == 10
    assert KVPool.num_blocks_for_budget(per_block - 1, 2, 16, 4, 64, torch.bfloat16) == 0
    with pytest.raises(ValueError, match="CUDA"):
        KVPool.num_blocks_for_gpu_fraction(0.9, 2, 16, 4, 64, torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="num_blocks"):
        KVPool(2, 0, 16, 4, 64, torch.float32, CPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pool_fraction_on_gpu() -> None:
    device = torch.device("cuda")
    free, total = torch.cuda.mem_get_info(device)
    blocks = KVPool.num_blocks_for_gpu_fraction(0.5, 2, 16, 4, 64, torch.bfloat16, device)
    per_block = KVPool.bytes_per_block(2, 16, 4, 64, torch.bfloat16)
    assert blocks == max(0, (int(0.5 * total) - (total - free)) // per_block)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_paged_prefix_matches_transformers(tiny_models: TinyModels) -> None:
    path = tiny_models.get("qwen3")
    device, ids = torch.device("cuda"), random_prompt(41, seed=7)
    loaded = load_model(path, device, torch.float32)
    c = loaded.config
    pool = KVPool(c.num_layers, 32, 4, c.num_kv_heads, c.head_dim, torch.float32, device)
    table = list(range(31, 20, -1))
    for start, end in ((0, 13), (13, 41)):
        batch = AttentionBatch.build([SpanInput(table, start, end - start)], 4, device)
        hidden = loaded.model(torch.tensor(ids[start:end], device=device), batch, pool)
    logits = loaded.model.compute_logits(hidden[batch.last_token_index])[0].cpu()
    torch.testing.assert_close(logits, reference_logits(path, ids)[-1], atol=1e-3, rtol=1e-3)


# ---- loader and config ------------------------------------------------------------------------


def test_loader_identity_and_tied_head(tiny_models: TinyModels) -> None:
    path = tiny_models.get("llama", tie_word_embeddings=True)
    loaded = ours(path)
    assert loaded.model_id == path.name
    assert len(loaded.revision) == 16 and loaded.revision == load_model(path, CPU, torch.float32).revision
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert not any(p.is_meta for p in loaded.model.parameters())


def test_fused_projections_keep_parameters_and_results(checkpoint: Path, monkeypatch) -> None:
    """The loader fuses q/k/v and gate/up into one product each: the checkpoint's
    parameters keep their names and values as views of the fused weight, and a forward
    gives bit for bit what the separate products give (each packed for the native product
    where it runs: a column's result is the same chain over K either way) (with torch's SwiGLU activation on
    both sides; the native one rounds its own way, checked in test_kernels)."""
    from computed import kernels

    monkeypatch.setattr(kernels, "silu_mul", lambda: None)
    monkeypatch.setattr(kernels, "packed_linear_swiglu", lambda: None)
    loaded = ours(checkpoint)
    loaded.model.pack_projections()  # again under the patch (a cached model packed without it)
    assert loaded.model.native is None  # NativeForward needs the native activation
    layer = loaded.model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.qkv_weight is not None and mlp.gate_up_weight is not None
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    assert torch.equal(attn.qkv_weight[attn.split_sizes[0] :][: attn.split_sizes[1]], attn.k_proj.weight)
    assert torch.equal(mlp.gate_up_weight[mlp.intermediate_size :], mlp.up_proj.weight)
    assert "model.layers.0.self_attn.qkv_weight" not in loaded.model.state_dict()
    assert not [
        name for name in loaded.model.state_dict() if "packed" in name
    ]  # packed copies are not parameters
    tensors = load_file(checkpoint / "model.safetensors")
    state = loaded.model.state_dict()
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor.float()), name
    ids = random_prompt(19, seed=3)

    def logits() -> torch.Tensor:
        runner = Paged(loaded)
        batch = AttentionBatch.build([SpanInput(runner.allocate(len(ids)), 0, len(ids))], 4, CPU)
        return runner.model.compute_logits(runner.model(torch.tensor(ids), batch, runner.pool))

    fused = logits()
    packed = loaded.model.model.layers[0].self_attn.qkv_packed is not None  # the native kernels loaded
    for module in loaded.model.modules():  # back to one product per projection
        for name in ("qkv_weight", "qkv_bias", "gate_up_weight", "qkv_packed", "gate_up_packed"):
            if getattr(module, name, None) is not None:
                setattr(module, name, None)
    try:
        loaded.model.pack_projections()  # the separate products packed as the fused ones were
        assert (loaded.model.model.layers[0].self_attn.q_proj.packed is not None) == packed
        assert torch.equal(logits(), fused)
    finally:
        monkeypatch.undo()
        loaded.model.fuse_projections()
        loaded.model.pack_projections()


def test_revision_changes_with_the_weights(tiny_models: TinyModels, tmp_path: Path) -> None:
    a, b = tiny_models.get("qwen2", seed=0), tiny_models.get("qwen2", seed=1)
    assert ours(a).revision != ours(b).revision
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in a.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    assert load_model(copy, CPU, torch.float32).revision == ours(a).revision


def test_sharded_checkpoint_loads_the_same(tiny_models: TinyModels, tmp_path: Path) -> None:
    source = tiny_models.get("qwen3")
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, tmp_path / shard, metadata={"format": "pt"})
    index = {"weight_map": {n: shard for shard, shard_names in shards.items() for n in shard_names}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_model(tmp_path, CPU, torch.float32)
    for (name, p), (_, q) in zip(sharded.model.named_parameters(), ours(source).model.named_parameters()):
        assert torch.equal(p, q), name


def test_loader_rejects_tensors_that_do_not_fit(tiny_models: TinyModels, tmp_path: Path) -> None:
    source = tiny_models.get("llama")
    for file in source.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(source / "model.safetensors")
    save_file(
        {**tensors, "model.layers.0.self_attn.surprise": torch.zeros(2)}, tmp_path / "model.safetensors"
    )
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        load_model(tmp_path, CPU, torch.float32)
    save_file({n: t for n, t in tensors.items() if n != "lm_head.weight"}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks"):
        load_model(tmp_path, CPU, torch.float32)
    save_file({**tensors, "model.norm.weight": torch.ones(3)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_model(tmp_path, CPU, torch.float32)


def test_classic_config_spelling_loads_the_same_model(tiny_models: TinyModels, tmp_path: Path) -> None:
    """Hub checkpoints spell RoPE as rope_theta + rope_scaling (transformers 5 writes rope_parameters)."""
    source = tiny_models.get("llama", rope_scaling=LLAMA3_ROPE_SCALING)
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(
        rope_theta=rope.pop("rope_theta"),
        rope_scaling=rope,
        torch_dtype=config.pop("dtype"),
        _name_or_path="meta-llama/Tiny-3.1",
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    classic = load_model(tmp_path, CPU, torch.float32)
    assert classic.config == ours(source).config and classic.model_id == "meta-llama/Tiny-3.1"
    ids = random_prompt(30, seed=9)
    torch.testing.assert_close(
        Paged(classic).prefill(list(range(8)), ids, [11]),
        reference_logits(source, ids)[-1],
        atol=TOLERANCE,
        rtol=0,
    )


def _llama_config(**changes) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    return {**config, **changes}


def test_config_reads_classic_rope_scaling_and_merges_eos() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = ModelConfig.from_dict(_llama_config(rope_scaling=scaling), {"eos_token_id": [9, 2, 8]})
    assert config.rope_theta == 500000.0 and config.rope_scaling.factor == 8.0
    assert config.eos_token_ids == (2, 9, 8) and config.bos_token_id == 1
    assert (
        config.head_dim == 16 and config.torch_dtype == "bfloat16" and config.max_position_embeddings == 2048
    )
    qwen2 = ModelConfig.from_dict(_llama_config(architectures=["Qwen2ForCausalLM"]))
    assert qwen2.attention_bias and not qwen2.has_qk_norm


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"architectures": ["MistralForCausalLM"]}, "not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"use_sliding_window": True}, "sliding"),
        ({"eos_token_id": 500}, "outside vocab"),
    ],
)
def test_config_rejects_what_it_cannot_run(changes: dict, message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict(_llama_config(**changes))


def test_llama3_rope_scaling_matters(tiny_models: TinyModels) -> None:
    """Guards the llama3 variant above: ignoring the scaling would change the logits."""
    path = tiny_models.get("llama", rope_scaling=LLAMA3_ROPE_SCALING)
    plain = tiny_models.get("llama")  # same seed, same weights, plain RoPE
    ids = random_prompt(41, seed=8)
    assert not torch.allclose(reference_logits(path, ids)[-1], reference_logits(plain, ids)[-1], atol=1e-2)


def test_runtime_does_not_import_transformers() -> None:
    import subprocess
    import sys

    code = (
        "import sys, computed.model, computed.attention, computed.kv_pool; "
        "sys.exit('transformers' in sys.modules)"
    )
    repo = Path(__file__).parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=repo, check=False).returncode == 0


def test_cascade_decode_over_shared_blocks_matches_dense_attention() -> None:
    """Decode queries whose tables share leading blocks (cascade path) vs a dense reference."""
    torch.manual_seed(1)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    pool = KVPool(1, 32, block, kv_heads, dim, torch.float32, CPU)
    shared = [7, 3]  # 8 shared tokens in two blocks
    tables = [shared + [11, 12], shared + [20], shared + [5, 6, 9], [30, 31]]
    lengths = [14, 9, 10, 6]  # context after this step; the last token is new
    keys = [torch.randn(n, kv_heads, dim) for n in lengths]
    values = [torch.randn(n, kv_heads, dim) for n in lengths]
    for i in range(1, 3):  # members agree on the shared tokens' K/V (same physical blocks)
        keys[i][:8], values[i][:8] = keys[0][:8], values[0][:8]
    for table, k, v, n in zip(tables, keys, values, lengths):
        for pos in range(n - 1):
            pool.key(0)[table[pos // block], pos % block] = k[pos]
            pool.value(0)[table[pos // block], pos % block] = v[pos]
    batch = AttentionBatch.build([SpanInput(t, n - 1, 1) for t, n in zip(tables, lengths)], block, CPU)
    assert [g.span_indices for g in batch.shared_prefixes] == [(0, 1, 2)]
    assert batch.shared_prefixes[0].num_blocks == 2
    q = torch.randn(4, heads, dim)
    out = paged_attention(
        q,
        torch.stack([k[-1] for k in keys]),
        torch.stack([v[-1] for v in values]),
        0,
        batch,
        pool,
        scale=dim**-0.5,
    )
    for i, (k, v) in enumerate(zip(keys, values)):
        kk = k.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # (H, n, D)
        vv = v.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        scores = q[i][:, None, :] @ kk.transpose(1, 2) * dim**-0.5  # (H, 1, n)
        expected = (scores.softmax(-1) @ vv)[:, 0]  # (H, D)
        torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=0)


def test_cascade_needs_a_suffix_and_two_members() -> None:
    one = AttentionBatch.build([SpanInput([1, 2], 7, 1)], 4, CPU)
    assert one.shared_prefixes == ()
    # Both queries sit in the shared second block: only the first block may be shared.
    two = AttentionBatch.build([SpanInput([1, 2], 6, 1), SpanInput([1, 2, 3], 5, 1)], 4, CPU)
    assert [g.num_blocks for g in two.shared_prefixes] == [1]


def test_cascade_prefill_chunks_after_a_shared_prefix_match_dense_attention() -> None:
    """Several new tokens per sequence after shared cached blocks: causal within the suffix."""
    torch.manual_seed(2)
    heads, kv_heads, dim, block = 4, 1, 8, 4
    pool = KVPool(1, 32, block, kv_heads, dim, torch.float32, CPU)
    shared = [4, 9, 2]  # 12 shared tokens
    tables = [shared + [10, 11], shared + [20, 21, 22], shared + [13]]
    cached, lengths = [13, 12, 12], [18, 21, 15]  # computed before this step, context after it
    keys = [torch.randn(n, kv_heads, dim) for n in lengths]
    values = [torch.randn(n, kv_heads, dim) for n in lengths]
    for i in (1, 2):
        keys[i][:12], values[i][:12] = keys[0][:12], values[0][:12]
    for table, k, v, c in zip(tables, keys, values, cached):
        for pos in range(c):
            pool.key(0)[table[pos // block], pos % block] = k[pos]
            pool.value(0)[table[pos // block], pos % block] = v[pos]
    batch = AttentionBatch.build(
        [SpanInput(t, c, n - c) for t, c, n in zip(tables, cached, lengths)], block, CPU
    )
    assert [(g.span_indices, g.num_blocks) for g in batch.shared_prefixes] == [((0, 1, 2), 3)]
    q = torch.randn(batch.num_tokens, heads, dim)
    k_new = torch.cat([k[c:] for k, c in zip(keys, cached)])
    v_new = torch.cat([v[c:] for v, c in zip(values, cached)])
    out = paged_attention(q, k_new, v_new, 0, batch, pool, scale=dim**-0.5)
    assert_matches_dense_attention(out, q, keys, values, cached, lengths, kv_heads)


def test_cascade_fallback_without_the_fused_cpu_kernel(monkeypatch) -> None:
    """The einsum path (used off CPU or in other dtypes) gives the same answers."""
    from computed import attention, kernels

    monkeypatch.setattr(attention, "_FLASH_CPU", None)
    monkeypatch.setattr(kernels, "paged_decode", lambda: None)
    monkeypatch.setattr(kernels, "paged_flash", lambda: None)
    monkeypatch.setattr(kernels, "merge_partials", lambda: None)
    test_cascade_decode_over_shared_blocks_matches_dense_attention()
    test_cascade_prefill_chunks_after_a_shared_prefix_match_dense_attention()
