"""The CUDA path's Triton code on CPU tensors, under Triton's interpreter: the fused layer
ops against torch's, and the static decode step (`computed.decode_graphs`) through the
cuda_triton backend, the fused ops and the modules' forward (what a CUDA graph captures)
against the eager step, bit for bit. Needs Triton installed (not a GPU): a CPU-only
session's check of code it cannot run on a device. Runs in a subprocess, as the
interpreter is chosen when a kernel is defined (`TRITON_INTERPRET=1`).

    pip install --target /tmp/tpkg triton
    PYTHONPATH=/tmp/tpkg .venv/bin/python -m pytest -m slow tests/computed/test_triton_interpreted.py
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_triton_code_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    run = subprocess.run(
        [sys.executable, "-m", "tests.computed.test_triton_interpreted"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]


def _layer_ops() -> None:
    from tests.computed import test_triton_layers as checks

    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        # The interpreter truncates float32 to bfloat16 where a GPU rounds to nearest.
        checks.check_norms(cpu, dtype, exact_sum=dtype == torch.float32)
        checks.check_silu_mul(cpu, dtype)
        checks.check_qk_norm_rotary(cpu, dtype)


def _static_decode() -> None:
    from computed import triton_attention
    from computed.attention import AttentionBatch, SpanInput
    from computed.backends.cuda_triton import CudaTriton
    from computed.decode_graphs import DecodeGraphs
    from computed.kv_pool import KVPool
    from computed.model import load_model
    from tests.models import TinyModels

    cpu, block = torch.device("cpu"), 4
    models = TinyModels(Path(tempfile.mkdtemp()))
    for arch, dtype, fused in (("llama", torch.float32, False), ("qwen3", torch.bfloat16, True)):
        model = load_model(models.get(arch), cpu, dtype).model
        model.native = None  # the modules' forward, as on CUDA
        model.use_attention_backend(CudaTriton(triton_attention._paged_flash))
        model.use_triton_layers(fused)
        c, rng = model.config, random.Random(1)
        pools = [KVPool(c.num_layers, 40, block, c.num_kv_heads, c.head_dim, dtype, cpu) for _ in range(2)]
        tables = [list(range(1 + 6 * i, 7 + 6 * i)) for i in range(5)]
        lens = [rng.randint(3, 15) for _ in range(5)]
        prompt = torch.tensor([rng.randrange(c.vocab_size) for _ in range(sum(lens))])
        for pool in pools:
            model(
                prompt,
                AttentionBatch.build([SpanInput(t, 0, n) for t, n in zip(tables, lens)], block, cpu),
                pool,
            )
        graphs = DecodeGraphs(model, pools[1], block, 8, 24, capture=False)
        for num_rows in (1, 3, 5):
            spans = [SpanInput(tables[i], lens[i], 1) for i in range(num_rows)]
            ids = [rng.randrange(c.vocab_size) for _ in range(num_rows)]
            batch = AttentionBatch.build(spans, block, cpu)
            eager = model.compute_logits(model(torch.tensor(ids), batch, pools[0]))
            static = model.compute_logits(graphs.run(ids, spans))
            assert torch.equal(eager, static) and torch.equal(pools[0].kv, pools[1].kv), (arch, num_rows)
            lens[:num_rows] = [n + 1 for n in lens[:num_rows]]


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    _layer_ops()
    _static_decode()
