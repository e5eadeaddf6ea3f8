"""8. GPU mode: a Qwen3-0.6B-shaped model (random bf16 weights) on nano-vllm's published workload.

nano-vllm's bench.py: 256 sequences, input and output lengths uniform in 100-1,024,
random token ids in 0-10,000, EOS ignored. Ours: both daemons, computed on CUDA in
bfloat16, all 256 as concurrent gRPC streams, greedy (nano-vllm samples at temperature
0.6: same work per token). Goal (issue 42): >= 15,000 output tok/s on an H100.

On CUDA the section also runs (issue 42):
- a shared-prefix workload: 256 requests sharing a 2,048-token prefix + 128 unique
  tokens, 128 out; throughput with prefix caching ÷ without (`cache_policy` NONE), and
  TTFT of a lone request warm ÷ cold;
- one decode step (256 rows x 1,024 keys) under torch.profiler (`bench.gpu_step`):
  device busy share and kernel launches per step.
The transformers baseline runs only off CUDA (`measure(..., "cpu", ...)`, a wiring
check with a tiny shape): on an H100 it cost 174 s and said nothing the peers do not.
Without CUDA the section says it was skipped and why.
"""

from __future__ import annotations

import random
import sys

from bench.context import BenchContext
from bench.driver import run_sync
from bench.hf_baseline import HfGenerator
from bench.report import BenchResult, Figure, Goal
from bench.stack import Stack

TITLE = "8. GPU mode"

# Qwen3-0.6B's published config (hidden 1024, 28 layers, 16/8 heads of 128, vocab 151,936).
QWEN3_0_6B = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151_936,
    "max_position_embeddings": 40_960,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
}
HF_BATCHES = (64,)  # one batch of all 256 ran past 330 s on an H100 before it was stopped


def run(ctx: BenchContext) -> BenchResult:
    import torch

    if not torch.cuda.is_available():
        reason = (
            f"skipped: torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"{'a CPU-only build' if torch.version.cuda is None else 'no usable CUDA device'})"
        )
        return BenchResult(
            "gpu",
            TITLE,
            [Figure("GPU throughput", reason)],
            "This machine has no GPU, so the GPU workload did not run. On a CUDA host, "
            "`python -m bench --only gpu` runs it.",
        )
    num_seqs = 32 if ctx.quick else 256
    return measure_cuda(ctx, num_seqs)


def measure_cuda(ctx: BenchContext, num_seqs: int) -> BenchResult:
    """The three GPU figures of issue 42 on the first CUDA device, no transformers."""
    import torch

    from bench.gpu_step import profile_decode_step

    model_dir = build_checkpoint(ctx.scratch("gpu") / "qwen3", QWEN3_0_6B, "bfloat16")
    prompts, outputs = workload(num_seqs, 1024)
    args = _computed_args("cuda", "bfloat16", num_seqs, 1024)
    with Stack(ctx.scratch("gpu"), *args, model=model_dir, threads=ctx.threads) as stack:
        run_sync(stack.computed_address, [prompts[0][:32]], 4, 1)  # warm-up (graphs captured at start)
        wall = _run_ours(stack.computed_address, prompts, outputs)
        tps = sum(outputs) / wall
        print(f"gpu: {tps:,.0f} output tok/s ({wall:.1f} s)", file=sys.stderr, flush=True)
        shared = _shared_prefix(stack.computed_address, num_seqs)
    step = profile_decode_step(model_dir, "cuda", torch.bfloat16, rows=min(num_seqs, 256), context=1024)
    figures = [
        Figure("output tok/s (nano-vllm's workload)", round(tps, 1), "tok/s", Goal(">=", 15_000.0)),
        Figure("shared prefix: cached ÷ uncached throughput", round(shared["speedup"], 2), "x"),
        Figure("shared prefix: TTFT warm ÷ cold", round(shared["ttft_ratio"], 3), "x"),
        Figure("decode step: device busy ÷ wall", round(step.busy_share, 3), ""),
        Figure("decode step: wall", round(step.wall_ms, 2), "ms"),
        Figure("decode step: kernel launches", round(step.launches), ""),
    ]
    details = (
        f"{num_seqs} sequences, input and output lengths uniform in 100-1,024, {sum(outputs):,} output "
        f"tokens, on {step.device}; computed `{' '.join(args)}`. Shared prefix: {shared['detail']}. "
        f"Decode step ({step.rows} rows x {step.context} keys, `python -m bench.gpu_step`): top kernels "
        + ", ".join(f"{name} {ms:.2f} ms" for name, ms in step.top[:5])
        + "."
    )
    return BenchResult("gpu", TITLE, figures, details)


def _computed_args(device: str, dtype: str, num_seqs: int, max_len: int) -> tuple[str, ...]:
    """computed's flags for `num_seqs` sequences of up to `max_len` tokens in and out."""
    return (
        "--device",
        device,
        "--dtype",
        dtype,
        "--max-num-seqs",
        str(num_seqs),
        "--max-num-batched-tokens",
        "16384",
        "--max-model-len",
        str(2 * max_len + 16),
    )


def _shared_prefix(address: str, num_seqs: int, prefix_len: int = 2048, unique: int = 128) -> dict:
    """`num_seqs` requests of one shared prefix + `unique` own tokens, 128 out each: wall
    with prefix caching (the prefix computed once, then hit) against without (policy
    NONE: every prompt computed whole), and a lone request's TTFT cold against warm."""
    import asyncio
    import time

    from bench.driver import generate_one
    from clients.aio_client import AsyncComputedClient

    rng = random.Random(7)
    prefix = [rng.randint(0, 10_000) for _ in range(prefix_len)]

    def prompts(tag: int) -> list[list[int]]:  # a fresh prefix per run: no run warms another
        head = [tag, *prefix[1:]]
        return [head + [rng.randint(0, 10_000) for _ in range(unique)] for _ in range(num_seqs)]

    async def one_run(batch: list[list[int]], policy: str) -> float:
        async with AsyncComputedClient(address) as client:
            started = time.perf_counter()
            await asyncio.gather(*(_generate(client, p, 128, policy) for p in batch))
            return time.perf_counter() - started

    async def ttft(prompt: list[int]) -> float:
        async with AsyncComputedClient(address) as client:
            return (await generate_one(client, prompt, 1)).ttft_s

    uncached = asyncio.run(one_run(prompts(10_001), "none"))
    cached = asyncio.run(one_run(prompts(10_002), "store"))
    lone = prompts(10_003)[0]
    cold = asyncio.run(ttft(lone))
    warm = asyncio.run(ttft(lone[:-1] + [lone[-1] + 1]))
    return {
        "speedup": uncached / cached,
        "ttft_ratio": warm / cold,
        "detail": (
            f"{num_seqs} x ({prefix_len} shared + {unique}), 128 out: {cached:.2f} s cached, "
            f"{uncached:.2f} s uncached; TTFT {warm * 1000:.1f} ms warm, {cold * 1000:.1f} ms cold"
        ),
    }


async def _generate(client, prompt: list[int], max_tokens: int, policy: str) -> None:
    stream = client.generate(
        token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0, cache_policy=policy
    )
    async for _ in stream:
        pass


def workload(num_seqs: int, max_len: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's: lengths uniform in 100..max_len, ids in 0..10,000."""
    rng = random.Random(seed)
    low = min(100, max_len)
    prompts = [[rng.randint(0, 10_000) for _ in range(rng.randint(low, max_len))] for _ in range(num_seqs)]
    outputs = [rng.randint(low, max_len) for _ in range(num_seqs)]
    return prompts, outputs


def measure(ctx: BenchContext, device: str, overrides: dict, num_seqs: int, max_len: int) -> BenchResult:
    """The workload on `device` (a CPU run with a tiny shape checks the wiring)."""
    import torch

    dtype = "bfloat16" if device == "cuda" else "float32"
    model_dir = build_checkpoint(ctx.scratch("gpu") / "qwen3", overrides, dtype)
    prompts, outputs = workload(num_seqs, max_len)
    num_tokens = sum(len(p) + o for p, o in zip(prompts, outputs))
    args = _computed_args(device, dtype, num_seqs, max_len)
    if device == "cpu":
        args += ("--num-blocks", str(num_tokens // 16 + 2 * num_seqs + 64))
    with Stack(ctx.scratch("gpu"), *args, model=model_dir, threads=ctx.threads) as stack:
        run_sync(stack.computed_address, [prompts[0][:32]], 4, 1)  # warm-up
        ours = _run_ours(stack.computed_address, prompts, outputs)
    total = sum(outputs)
    print(f"gpu: ours {ours:.1f} s, {total / ours:,.0f} output tok/s", file=sys.stderr, flush=True)
    hf = HfGenerator(model_dir, dtype=dtype, device=device)
    hf.generate([prompts[0][:32]], 4, 1)  # warm-up
    order = sorted(range(num_seqs), key=lambda i: outputs[i])
    hf_walls = {}
    for batch in HF_BATCHES:
        theirs = hf.generate([prompts[i] for i in order], [outputs[i] for i in order], min(batch, num_seqs))
        assert theirs.num_output_tokens == total
        hf_walls[batch] = theirs.wall_s
        print(f"gpu: transformers batch {batch}: {theirs.wall_s:.1f} s", file=sys.stderr, flush=True)
    hf_batch = min(hf_walls, key=hf_walls.get)
    ours_tps, hf_tps = total / ours, total / hf_walls[hf_batch]
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    figures = [
        Figure("ours ÷ transformers, output tok/s", round(ours_tps / hf_tps, 2), "x"),
        Figure("ours, output tok/s", round(ours_tps, 1), "tok/s"),
        Figure("transformers, output tok/s", round(hf_tps, 1), "tok/s"),
    ]
    details = (
        f"{num_seqs} sequences, input and output lengths uniform in {min(100, max_len)}-{max_len}, "
        f"{total:,} output "
        f"tokens, on {gpu}; computed `{' '.join(args)}`; transformers in batches of "
        + ", ".join(f"{b} ({w:.1f} s)" for b, w in hf_walls.items())
        + ", prompts sorted by output length."
    )
    return BenchResult("gpu", TITLE, figures, details)


def build_checkpoint(path, overrides: dict, dtype: str):
    """A Qwen3 checkpoint with transformers' own random init (std 0.02, so activations stay
    finite through 28 layers) saved in `dtype`, with the test models' tokenizer files."""
    import torch
    import transformers

    from tools.tiny_models import make_tiny_model

    make_tiny_model(path, "qwen3", num_hidden_layers=1)  # tokenizer, generation config
    tiny = transformers.AutoConfig.from_pretrained(path)
    config = transformers.Qwen3Config(
        **{**QWEN3_0_6B, **overrides, "bos_token_id": tiny.bos_token_id, "eos_token_id": tiny.eos_token_id}
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(getattr(torch, dtype)).eval()
    for stale in path.glob("*.safetensors*"):
        stale.unlink()
    model.save_pretrained(path)
    return path


def _run_ours(address: str, prompts: list[list[int]], outputs: list[int]) -> float:
    """Wall seconds for all prompts at once, each with its own max_tokens."""
    import asyncio
    import time

    from bench.driver import generate_one
    from clients.aio_client import AsyncComputedClient

    async def go() -> float:
        async with AsyncComputedClient(address) as client:
            started = time.perf_counter()
            done = await asyncio.gather(*(generate_one(client, p, o) for p, o in zip(prompts, outputs)))
            wall = time.perf_counter() - started
            assert [d.completion_tokens for d in done] == outputs, "every request generates what it asked"
            return wall

    return asyncio.run(go())
