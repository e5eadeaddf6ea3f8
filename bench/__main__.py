"""`python -m bench [--quick] [--only NAME ...]`: run the benchmarks, print one table, write a report.

Full mode writes BENCHMARKS.md at the repository root and the plots under
bench/results/ (results.json there keeps every section, so `--only` replaces one
section and keeps the rest). Quick mode (CI) writes the same files under
run/bench-quick/ and never touches the committed report. Exit status 1 when a
benchmark could not be measured (the harness raised); a missed goal is reported, not
an error.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console

from bench.context import BenchContext
from bench.report import (
    BenchResult,
    load_results,
    machine_info,
    machine_line,
    print_table,
    render_markdown,
    save_results,
)

REPO = Path(__file__).resolve().parent.parent
# --only name -> module with run(ctx) -> BenchResult, in report order.
BENCHMARKS: dict[str, str] = {
    "prefill": "bench.prefill",
    "ttft": "bench.ttft",
    "throughput": "bench.throughput",
    "directory_overhead": "bench.directory_overhead",
    "capacity": "bench.capacity",
    "eviction": "bench.eviction_quality",
    "kv_memory": "bench.kv_memory",
    "gpu": "bench.gpu",
    "host_overhead": "bench.host_overhead",
    "tiers": "bench.tiers",
    "shared": "bench.shared_tier",
}
# Run only when named: peer's install takes minutes and gigabytes (`make bench-peer`); gateway
# has its own target (`make bench-gateway`).
ON_REQUEST: dict[str, str] = {
    "peer": "bench.peer_vllm",
    "gateway": "bench.gateway",
    "serving": "bench.serving_http",
}
SECTIONS = {**BENCHMARKS, **ON_REQUEST}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes (CI); writes run/bench-quick/ instead of BENCHMARKS.md",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=list(SECTIONS),
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(SECTIONS)}",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of every process that runs a model: computed and the "
        "transformers baseline alike (0, the default: torch's default, every core, as "
        "each library runs out of the box)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="report folder (default: the repository root; run/bench-quick with --quick)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=max(120, Console().width))
    names = args.only or list(BENCHMARKS)
    out = args.out or (REPO / "run" / "bench-quick" if args.quick else REPO)
    plot_dir = out / "bench" / "results" if out == REPO else out / "results"
    plot_dir.mkdir(parents=True, exist_ok=True)
    threads = args.threads or None
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    machine = machine_info()
    console.print(f"[bold]machine:[/bold] {machine_line(machine)}")
    results: list[BenchResult] = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-"))
    try:
        for name in names:
            command = f"python -m bench{' --quick' if args.quick else ''} --only {name}"
            if args.threads != 0:
                command += f" --threads {args.threads}"
            ctx = BenchContext(args.quick, workdir, plot_dir, command, threads)
            console.rule(f"[bold]{name}")
            results.append(_run_one(name, ctx, machine, console))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(results, console)
    store = plot_dir / "results.json"
    save_results(store, results)
    stored = load_results(store)
    ordered = [stored[key] for key in SECTIONS if key in stored]
    report = out / "BENCHMARKS.md"
    report.write_text(render_markdown(ordered, str(plot_dir.relative_to(out)), _header(args.quick)))
    console.print(f"report: {report}")
    return 1 if any(r.error is not None for r in results) else 0


def _run_one(name: str, ctx: BenchContext, machine: dict, console: Console) -> BenchResult:
    started = time.perf_counter()
    title = name
    try:
        module = importlib.import_module(SECTIONS[name])
        title = module.TITLE
        result = module.run(ctx)
    except Exception as exc:  # noqa: BLE001 - one broken benchmark must not hide the others
        console.print(traceback.format_exc(), markup=False)
        result = BenchResult(name, title, error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
    result.command = ctx.command
    result.machine = machine
    result.seconds = time.perf_counter() - started
    console.print(f"{name}: {result.seconds:.0f} s")
    return result


def _header(quick: bool) -> str:
    mode = "quick mode: CI sizes, the numbers are smoke checks, not results" if quick else "full mode"
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"# Benchmarks\n\nWritten by `python -m bench{' --quick' if quick else ''}` ({mode}); "
        f"last run {when}. Every figure is a ratio of two things measured side by side in the same "
        f"run, on a machine shared with other work, so absolute times are noisy and the ratios are "
        f"what to read. Each section names the machine it ran on and the command that reproduces it."
    )


if __name__ == "__main__":
    sys.exit(main())
