"""A decode step on CPU through `ModelRunner.run`, eager against the static-buffer path
(`computed.decode_graphs`, what a CUDA graph replays; run eagerly here), interleaved,
median of 15 each. The ratio decides `--cuda-graphs`' CPU default.

    .venv/bin/python -m bench.decode_graphs
"""

from __future__ import annotations

import time

import torch

BLOCK = 16


def main() -> None:
    from computed.attention import SpanInput
    from computed.config import DEFAULT_MODEL_DIR
    from computed.kv_pool import KVPool
    from computed.model import load_model
    from computed.model_runner import ForwardInput, ModelRunner
    from computed.sequence import SamplingParams

    cpu = torch.device("cpu")
    loaded = load_model(DEFAULT_MODEL_DIR, cpu, torch.float32)
    model, c = loaded.model, loaded.config
    pool = KVPool(c.num_layers, 8192, BLOCK, c.num_kv_heads, c.head_dim, torch.float32, cpu)
    runner = ModelRunner(model, pool, BLOCK, cpu, decode_graphs=True, max_num_seqs=64, max_context=2048)
    graphs = runner.decode_graphs
    assert graphs is not None, "the static path needs the native kernels on CPU"
    blocks = torch.randperm(8192).tolist()

    def decode(rows: int, context: int) -> ForwardInput:
        per = -(-context // BLOCK)
        spans = [SpanInput(blocks[i * per : (i + 1) * per], context - 1, 1) for i in range(rows)]
        ids = list(range(rows))
        return ForwardInput([5] * rows, spans, ids, ids, [SamplingParams()] * rows, ids, rows)

    print(
        f"decode steps, ModelRunner.run on CPU ({torch.get_num_threads()} threads): eager vs static buffers (ms)"
    )
    for rows, context in ((1, 17), (3, 600), (8, 1101), (20, 200), (64, 1121)):
        inp, times = decode(rows, context), {"eager": [], "static": []}
        bucket = graphs.bucket_for(inp.spans)
        for _ in range(15):
            for name, use in (("eager", None), ("static", graphs)):
                runner.decode_graphs = use
                started = time.perf_counter()
                runner.run(inp)
                times[name].append((time.perf_counter() - started) * 1e3)
        runner.decode_graphs = graphs
        eager, static = (sorted(t)[7] for t in times.values())
        what = f"{rows} rows (bucket {bucket}) x {context} keys"
        print(f"  {what:32} eager {eager:6.2f}, static {static:6.2f}, static / eager {static / eager:.2f}")


if __name__ == "__main__":
    main()
