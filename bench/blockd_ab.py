"""Two blockd builds side by side over gRPC: the capacity bench's workers, runs interleaved.

Starts one blockd from this checkout and one from `--base` (another checkout of the
repository, e.g. `git worktree add /tmp/base <commit>` with the generated code copied
in), then alternates between them: closed-loop rounds of `bench.blockd_grpc`'s batched
workers (8 workers, 4,096-token prompts, packed wire form) for the maximum admissions/s,
then open-loop rounds at one offered rate for both (half the base's best maximum), for
the Step latency at equal load. The machine is shared, so only the ratios of one run
mean anything.

    python -m bench.blockd_ab --base /tmp/base [--rounds 3] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from bench.blockd_grpc import ADMITS_PER_STEP, NUM_WORKERS, _batched, _ms, start_blockd

REPO = Path(__file__).resolve().parent.parent


async def compare(addresses: dict[str, str], rounds: int, seconds: float) -> dict:
    closed: dict[str, list[float]] = {name: [] for name in addresses}
    for i in range(rounds):
        order = list(addresses) if i % 2 == 0 else list(reversed(addresses))
        for name in order:
            closed[name].append((await _batched(addresses[name], seconds, None))[0])
    offered = max(closed["base"]) * 0.5
    period = NUM_WORKERS * ADMITS_PER_STEP / offered
    latencies: dict[str, list[float]] = {name: [] for name in addresses}
    served: dict[str, list[float]] = {name: [] for name in addresses}
    for i in range(rounds):
        order = list(addresses) if i % 2 == 0 else list(reversed(addresses))
        for name in order:
            rate, lat = await _batched(addresses[name], seconds, period)
            served[name].append(rate)
            latencies[name] += lat
    figures: dict = {"offered_admissions_per_s": round(offered, 1)}
    for name in addresses:
        figures[f"{name}_closed_admissions_per_s"] = [round(x, 1) for x in closed[name]]
        figures[f"{name}_closed_best"] = round(max(closed[name]), 1)
        figures[f"{name}_open_served_per_s"] = round(statistics.mean(served[name]), 1)
        figures[f"{name}_open_step_p50_ms"] = _ms(latencies[name], 50)
        figures[f"{name}_open_step_p99_ms"] = _ms(latencies[name], 99)
    figures["new_over_base_closed_best"] = round(figures["new_closed_best"] / figures["base_closed_best"], 3)
    figures["new_over_base_closed_median"] = round(
        statistics.median(closed["new"]) / statistics.median(closed["base"]), 3
    )
    return figures


def main(base: Path, rounds: int, seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        procs = {}
        try:
            for name, tree in (("base", base), ("new", REPO)):
                procs[name] = start_blockd(Path(workdir), name, tree)
            figures = asyncio.run(compare({n: a for n, (_, a) in procs.items()}, rounds, seconds))
        finally:
            for proc, _ in procs.values():
                proc.terminate()
                proc.wait(30)
    print(f"blockd A/B over gRPC, {NUM_WORKERS} workers, {rounds} interleaved rounds x {seconds:.0f} s each:")
    for key, value in figures.items():
        print(f"  {key}: {value}")
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the other checkout (its blockd is 'base')")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    main(args.base, args.rounds, args.seconds)
