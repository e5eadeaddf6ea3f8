"""One decode step under torch.profiler: device busy share, kernel launches, host time.

`python -m bench.gpu_step [--device cuda] [--rows 256] [--context 1024]` loads a
checkpoint (default: a Qwen3-0.6B-shaped one with random weights, built once under
run/), fills a pool with `rows` sequences of `context` tokens each, and profiles
`--steps` decode steps through `ModelRunner.run` after a warm-up. It prints, per step:

- wall ms (host clock around `run`, the device synchronised after each step);
- device busy ms and busy ÷ wall (CUDA: the kernels' summed durations; a step whose
  host work is off the critical path keeps the device busy nearly all its wall);
- kernel launches (CUDA kernels, memcpy and memset events; a CUDA graph replay counts
  its kernels too, so compare eager and graph runs by wall and busy share);
- the top operators by self time.

On a CPU it profiles the same step (operators and their CPU time, summed over the
intra-op threads, so busy can exceed the wall), which checks the wiring; the device figures are what issue 42 asks of a GPU run (`bench/device_check.sh`).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
BLOCK = 16


@dataclass(frozen=True)
class StepProfile:
    device: str
    graphs: bool  # served from the static decode buffers (captured graphs on CUDA)
    rows: int
    context: int
    wall_ms: float  # per step
    busy_ms: float  # per step: device kernels' summed time (CPU: operators' self time)
    launches: float  # per step: device kernels, copies and sets (CPU: operator calls)
    top: list[tuple[str, float]]  # (operator, self ms per step), largest first

    @property
    def busy_share(self) -> float:
        return self.busy_ms / self.wall_ms if self.wall_ms else 0.0


def profile_decode_step(
    model_dir: Path,
    device: str,
    dtype: torch.dtype,
    rows: int,
    context: int,
    steps: int = 5,
    graphs: bool | None = None,
) -> StepProfile:
    """Profile `steps` decode steps of `rows` sequences over `context` cached tokens each;
    `graphs`: run them from the static decode buffers (CUDA graphs on CUDA; None: on CUDA
    only, computed's default)."""
    from computed.attention import SpanInput
    from computed.kv_pool import KVPool
    from computed.model import load_model
    from computed.model_runner import ForwardInput, ModelRunner
    from computed.sequence import SamplingParams

    dev = torch.device(device)
    loaded = load_model(model_dir, dev, dtype)
    model, c = loaded.model, loaded.config
    per = -(-(context + steps + 8) // BLOCK)
    pool = KVPool(c.num_layers, rows * per, BLOCK, c.num_kv_heads, c.head_dim, dtype, dev)
    graphs = dev.type == "cuda" if graphs is None else graphs
    runner = ModelRunner(
        model, pool, BLOCK, dev, decode_graphs=graphs, max_num_seqs=rows, max_context=context + steps + 8
    )
    tables = [list(range(i * per, (i + 1) * per)) for i in range(rows)]

    def decode(at: int) -> ForwardInput:  # every row's token at position `at`
        spans = [SpanInput(t, at, 1) for t in tables]
        ids = list(range(rows))
        return ForwardInput([7] * rows, spans, ids, ids, [SamplingParams()] * rows, ids, rows)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for i in range(3):  # warm-up: kernels compiled, allocator and graphs ready
        runner.run(decode(context + i))
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    walls = []
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(steps):
            started = time.perf_counter()
            runner.run(decode(context + 3 + i))
            sync()
            walls.append(time.perf_counter() - started)
    events = prof.key_averages()
    if dev.type == "cuda":
        device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_us = sum(e.device_time for e in device_events)
        launches = len(device_events)
        top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:10]
        top_ms = [(e.key, e.self_device_time_total / 1000 / steps) for e in top]
    else:
        busy_us = sum(e.self_cpu_time_total for e in events)
        launches = sum(e.count for e in events)
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
        top_ms = [(e.key, e.self_cpu_time_total / 1000 / steps) for e in top]
    return StepProfile(
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        graphs=runner.decode_graphs is not None,
        rows=rows,
        context=context,
        wall_ms=1000 * sorted(walls)[len(walls) // 2],
        busy_ms=busy_us / 1000 / steps,
        launches=launches / steps,
        top=top_ms,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_step", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--model", type=Path, default=None, help="checkpoint folder (default: Qwen3-0.6B shape)"
    )
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode from the static buffers (CUDA graphs on CUDA); default: on CUDA only",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the profile here")
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model_dir = args.model
    if model_dir is None:
        from bench.gpu import QWEN3_0_6B, build_checkpoint

        model_dir = REPO / "run" / "gpu_step" / f"qwen3-0.6b-{str(dtype).split('.')[-1]}"
        if not (model_dir / "config.json").exists():
            model_dir.mkdir(parents=True, exist_ok=True)
            build_checkpoint(model_dir, QWEN3_0_6B, str(dtype).split(".")[-1])
    p = profile_decode_step(model_dir, args.device, dtype, args.rows, args.context, args.steps, args.graphs)
    print(
        f"{p.device}{' (graphs)' if p.graphs else ''}: {p.rows} rows x {p.context} keys: wall {p.wall_ms:.2f} ms/step, busy {p.busy_ms:.2f} ms "
        f"({p.busy_share:.0%}), {p.launches:.0f} launches/step"
    )
    for name, ms in p.top:
        print(f"  {ms:8.3f} ms  {name}")
    if args.json is not None:
        args.json.write_text(json.dumps({**asdict(p), "busy_share": p.busy_share}, indent=1))


if __name__ == "__main__":
    main()
