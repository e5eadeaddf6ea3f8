"""Per-call cost of the attention backends against the if/elif they replaced, interleaved
in one process: `computed.attention` as it was at a git revision (loaded from `git show`)
and as it is, the backend passed (as the model does, chosen once) or asked per call. One
layer's `paged_attention` on the default model's heads, then a prefill step through
`ModelRunner.run` (its layer loop calls `attend`), median of 31 each.

    .venv/bin/python -m bench.attention_backends [REV]   # REV: default 2a99ddd (before the registry)
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from computed import attention
from computed.attention import AttentionBatch, SpanInput
from computed.backends.registry import AttentionTarget, select_attention_backend
from computed.config import DEFAULT_MODEL_DIR
from computed.kv_pool import KVPool
from computed.model import load_model

BLOCK = 16
CPU = torch.device("cpu")


def old_attention(rev: str):
    """`computed/attention.py` at `rev`, imported as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:computed/attention.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "attention_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("attention_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def median_ms(fns: dict[str, Callable[[], object]], repeats: int = 31) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved: the machine's load hits all alike
            started = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - started) * 1e3)
    return {name: sorted(t)[repeats // 2] for name, t in times.items()}


def main() -> None:
    rev = sys.argv[1] if len(sys.argv) > 1 else "2a99ddd"
    before = old_attention(rev)
    c = load_model(DEFAULT_MODEL_DIR, CPU, torch.float32).config
    heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim
    pool = KVPool(1, 4096, BLOCK, kv_heads, dim, torch.float32, CPU)
    pool.kv.normal_()
    target = AttentionTarget(CPU, torch.float32, torch.float32, dim, heads // kv_heads)
    backend = select_attention_backend(target).backend
    blocks = torch.randperm(4096).tolist()
    print(f"one layer's paged_attention, {heads}/{kv_heads} heads x {dim}, backend {backend.name} (ms)")
    shapes = {
        "decode 1 row x 17": [SpanInput(blocks[:2], 16, 1)],
        "decode 8 rows x 1,101": [SpanInput(blocks[i * 70 : (i + 1) * 70], 1100, 1) for i in range(8)],
        "decode 16 rows, 512 shared + 33": [
            SpanInput(blocks[:32] + blocks[40 + 3 * i : 43 + 3 * i], 544, 1) for i in range(16)
        ],
        "prefill 64 after 448 cached": [SpanInput(blocks[:32], 448, 64)],
    }
    scale = dim**-0.5
    for what, spans in shapes.items():
        batch = AttentionBatch.build(spans, BLOCK, CPU, attention.decode_cascade(CPU, torch.float32, dim))
        q = torch.randn(batch.num_tokens, heads, dim)
        k, v = torch.randn(2, batch.num_tokens, kv_heads, dim).unbind(0)
        args = (q, k, v, 0, batch, pool, scale)
        ms = median_ms(
            {
                "before": partial(before.paged_attention, *args),
                "backend": partial(attention.paged_attention, *args, backend),
                "per call": partial(attention.paged_attention, *args),
            }
        )
        print(
            f"  {what:34} before {ms['before']:.4f}, backend {ms['backend']:.4f} "
            f"({ms['backend'] / ms['before']:.2f}x), asked per call {ms['per call']:.4f} "
            f"({ms['per call'] / ms['before']:.2f}x)"
        )


if __name__ == "__main__":
    main()
