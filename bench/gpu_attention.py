"""`python -m bench.gpu_attention`: one layer's batched paged attention on CUDA, as a step runs it.

Qwen3-0.6B's heads (16 query / 8 K/V heads of 128), bfloat16 K/V, block size 16. Each
shape is an `AttentionBatch` of the kind the engine builds (decode rows, prefill chunks,
decode rows over a shared prefix, which the plan cascades); milliseconds per
`paged_attention` call (write + attend + merge), median of CUDA-event timings, through
`computed.triton_attention`'s kernel and through the float32 matmul path it replaces
(`COMPUTED_TRITON=0`). Also the bytes of K/V the step must read at least, over the time.
"""

from __future__ import annotations

import statistics
from functools import partial

import torch

from computed import triton_attention
from computed.attention import AttentionBatch, SpanInput, paged_attention
from computed.kv_pool import KVPool

HEADS, KV_HEADS, DIM, BLOCK = 16, 8, 128, 16
SHAPES = [  # (what, number of sequences, tokens cached each, new tokens each, shared prefix)
    ("decode, 256 rows x 1,024 context", 256, 1024, 1, 0),
    ("decode, 256 rows x 2,048 context", 256, 2048, 1, 0),
    ("decode, 256 rows over a 1,024-token shared prefix + 64", 256, 1088, 1, 1024),
    ("prefill, 16 chunks x 1,024 new tokens", 16, 0, 1024, 0),
    ("prefill, 64 chunks x 64 new after a 1,024 shared prefix", 64, 1024, 64, 1024),
]


def _batch(num_seqs: int, cached: int, new: int, shared: int, device) -> tuple[AttentionBatch, int]:
    per_seq = -(-(cached + new) // BLOCK)
    shared_blocks = shared // BLOCK
    prefix = list(range(shared_blocks))
    next_block = shared_blocks
    spans = []
    for _ in range(num_seqs):
        own = list(range(next_block, next_block + per_seq - shared_blocks))
        next_block += len(own)
        spans.append(SpanInput(prefix + own, cached, new))
    return AttentionBatch.build(spans, BLOCK, device), next_block


def _time(fn, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("python -m bench.gpu_attention needs a CUDA device")
    device = torch.device("cuda")
    triton_op = triton_attention.paged_flash()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; ms per layer call, median of 30")
    print(f"{'tile shape':58} {'triton':>8} {'matmul':>8} {'ratio':>6} {'K/V GB/s':>9}")
    for what, num_seqs, cached, new, shared in SHAPES:
        batch, num_blocks = _batch(num_seqs, cached, new, shared, device)
        pool = KVPool(1, num_blocks, BLOCK, KV_HEADS, DIM, torch.bfloat16, device)
        pool.key(0).normal_()
        pool.value(0).normal_()
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(batch.num_tokens, HEADS, DIM, device=device, dtype=torch.bfloat16, generator=gen)
        kv = torch.randn(batch.num_tokens, KV_HEADS, DIM, device=device, dtype=torch.bfloat16, generator=gen)
        timings = {}
        for name, op in (("triton", triton_op), ("matmul", None)):
            triton_attention.paged_flash = lambda op=op: op  # the accessor `attention` asks
            try:
                timings[name] = _time(partial(paged_attention, q, kv, kv, 0, batch, pool, DIM**-0.5))
            except torch.OutOfMemoryError:
                timings[name] = float("nan")
            torch.cuda.empty_cache()
        distinct_tokens = shared + num_seqs * (cached + new - shared)
        kv_bytes = 2 * distinct_tokens * KV_HEADS * DIM * 2
        print(
            f"{what:58} {timings['triton']:8.3f} {timings['matmul']:8.3f} "
            f"{timings['matmul'] / timings['triton']:6.1f} {kv_bytes / timings['triton'] / 1e6:9.0f}"
        )


if __name__ == "__main__":
    main()
