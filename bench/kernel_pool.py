"""`python -m bench.kernel_pool`: the native kernels' own parallel loop against torch's
OpenMP team, on a quiet machine and beside a process that keeps a core busy half the time.

Why it exists: computed's forward shares the cores with its event loop, the gateway and
the clients. A parallel region on torch's OpenMP team ends only when every thread of the
team has reached its barrier, so one descheduled thread stalls every region;
computed/kernels/parallel.h lets the calling thread take over what a helper has not
started. Two steps of the built-in model (bfloat16 pool, as computed runs it here), each
timed as the median of 30 runs after 10:

- decode: 32 rows, each with 40 private tokens after a shared 1,024-token prefix;
- prefill: 32 new 16-token suffixes after a cached shared 1,024-token prefix (the first
  forward of a wave in `python -m bench --only serving`'s shared workload).

Each setting runs in its own process (the loop reads COMPUTED_KERNEL_POOL once): "omp"
(at::parallel_for, OMP_WAIT_POLICY unset as torch leaves it), "own" (parallel.h, with
OMP_WAIT_POLICY=PASSIVE as computed sets it), and "1 thread". The competitor spins for
`--busy-ms` then sleeps for `--idle-ms`, at the same priority. It prints each time and
the ratio own ÷ omp per load.

    python -m bench.kernel_pool [--busy-ms 1] [--idle-ms 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {  # name -> (env, torch threads: None = torch's default)
    "omp": ({"COMPUTED_KERNEL_POOL": "omp"}, None),
    "own": ({"COMPUTED_KERNEL_POOL": "own", "OMP_WAIT_POLICY": "PASSIVE"}, None),
    "1 thread": ({"COMPUTED_KERNEL_POOL": "own", "OMP_WAIT_POLICY": "PASSIVE"}, 1),
}
BLOCK = 16


def measure(threads: int | None) -> dict[str, float]:
    """Median ms of the decode and prefill steps (in this process)."""
    import torch

    from computed.attention import SpanInput
    from computed.config import DEFAULT_MODEL_DIR
    from computed.kv_pool import KVPool
    from computed.model import load_model
    from computed.model_runner import ForwardInput, ModelRunner
    from computed.sequence import SamplingParams

    if threads is not None:
        torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    loaded = load_model(DEFAULT_MODEL_DIR, cpu, torch.float32, products=torch.bfloat16)
    c = loaded.config
    pool = KVPool(c.num_layers, 4096, BLOCK, c.num_kv_heads, c.head_dim, torch.bfloat16, cpu)
    runner = ModelRunner(loaded.model, pool, BLOCK, cpu)
    blocks = torch.randperm(4096, generator=torch.Generator().manual_seed(0)).tolist()
    prefix, rest = blocks[: 1024 // BLOCK], blocks[1024 // BLOCK :]

    def step(decode_rows: int, new_seqs: int) -> ForwardInput:
        per = -(-41 // BLOCK)  # 40 private tokens and the one decoded
        spans = [SpanInput(prefix + rest[i * per : (i + 1) * per], 1024 + 40, 1) for i in range(decode_rows)]
        tokens = [5] * decode_rows
        rows = list(range(decode_rows))
        for j in range(new_seqs):
            start = decode_rows * per + j
            spans.append(SpanInput(prefix + rest[start : start + 1], 1024, BLOCK))
            tokens += [7] * BLOCK
            rows.append(decode_rows + (j + 1) * BLOCK - 1)
        n = decode_rows + new_seqs
        return ForwardInput(tokens, spans, rows, list(range(n)), [SamplingParams()] * n, list(range(n)), n)

    times = {}
    for name, inp in (("decode", step(32, 0)), ("prefill", step(0, 32))):
        for _ in range(10):
            runner.run(inp)
        runs = []
        for _ in range(30):
            start = time.perf_counter()
            runner.run(inp)
            runs.append(time.perf_counter() - start)
        times[name] = sorted(runs)[len(runs) // 2] * 1e3
    return times


def _child(setting: str) -> dict[str, float]:
    env, threads = SETTINGS[setting]
    code = f"import json; from bench.kernel_pool import measure; print(json.dumps(measure({threads!r})))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"{setting}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _competitor(busy_ms: float, idle_ms: float) -> subprocess.Popen:
    code = (
        "import time\n"
        f"busy, idle = {busy_ms / 1e3}, {idle_ms / 1e3}\n"
        "while True:\n"
        "    t = time.perf_counter()\n"
        "    while time.perf_counter() - t < busy: pass\n"
        "    time.sleep(idle)\n"
    )
    return subprocess.Popen([sys.executable, "-c", code])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-ms", type=float, default=1.0)
    parser.add_argument("--idle-ms", type=float, default=1.0)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; median ms of 30 steps (bfloat16 pool, built-in model)")
    print("| load | setting | decode ms | prefill ms |")
    print("|---|---|---|---|")
    for load in ("quiet", f"a process busy {args.busy_ms:g} ms of every {args.busy_ms + args.idle_ms:g}"):
        competitor = None if load == "quiet" else _competitor(args.busy_ms, args.idle_ms)
        try:
            found = {setting: _child(setting) for setting in SETTINGS}
        finally:
            if competitor is not None:
                competitor.kill()
                competitor.wait()
        for setting, times in found.items():
            print(f"| {load} | {setting} | {times['decode']:.2f} | {times['prefill']:.2f} |")
        own, omp = found["own"], found["omp"]
        print(
            f"| {load} | own ÷ omp | {own['decode'] / omp['decode']:.2f} | {own['prefill'] / omp['prefill']:.2f} |"
        )


if __name__ == "__main__":
    main()
