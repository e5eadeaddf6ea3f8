"""blockd's garbage collection settings, side by side: tuned (young collections only,
the start-up heap frozen: `blockd.server._tune_gc`) against CPython's defaults.

Two blockd processes, one each way (BLOCKD_GC=default), serve the open loop of
bench.blockd_grpc (8 workers, 4,096-token prompts) at the same offered rate, in turns
(tuned, default, default, tuned) so the machine's other load falls on both alike and
each setting runs first once: the process that ran first in a turn had the higher p99
whatever its setting (4 settings of garbage collection in 3 orders, 3 turns each). The
figure is the Step p99 of each; the rate is half the tuned blockd's closed-loop maximum.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.blockd_grpc import ADMITS_PER_STEP, NUM_WORKERS, OPEN_LOOP_LOAD, REPO, _batched, _ms


def _start(workdir: Path, gc_mode: str) -> tuple[subprocess.Popen, str]:
    ready = workdir / f"{gc_mode}.ready"
    with open(workdir / f"{gc_mode}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "blockd", "--listen", "127.0.0.1:0", "--lease-ttl", "60"]
            + ["--ready-file", str(ready)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "BLOCKD_GC": gc_mode},
        )
    deadline = time.monotonic() + 60
    while not (ready.exists() and ready.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, (workdir / f"{gc_mode}.log").read_text()
        time.sleep(0.05)
    return proc, ready.read_text().strip()


async def _run(addresses: dict[str, str], seconds: float) -> dict:
    maximum, _ = await _batched(addresses["tuned"], seconds, None)
    period = NUM_WORKERS * ADMITS_PER_STEP / (maximum * OPEN_LOOP_LOAD)
    latencies: dict[str, list[float]] = {"tuned": [], "default": []}
    for turn in range(2):
        for mode in ("tuned", "default") if turn % 2 == 0 else ("default", "tuned"):
            latencies[mode] += (await _batched(addresses[mode], seconds, period))[1]
    return {
        "offered_admissions_per_s": round(maximum * OPEN_LOOP_LOAD, 1),
        "tuned_step_p50_ms": _ms(latencies["tuned"], 50),
        "tuned_step_p99_ms": _ms(latencies["tuned"], 99),
        "default_step_p50_ms": _ms(latencies["default"], 50),
        "default_step_p99_ms": _ms(latencies["default"], 99),
        "default_over_tuned_p99": round(
            statistics.quantiles(latencies["default"], n=100)[98]
            / statistics.quantiles(latencies["tuned"], n=100)[98],
            2,
        ),
    }


def main(quick: bool = False) -> dict:
    seconds = 3.0 if quick else 10.0
    with tempfile.TemporaryDirectory() as workdir:
        procs = {mode: _start(Path(workdir), mode) for mode in ("tuned", "default")}
        try:
            figures = asyncio.run(_run({mode: address for mode, (_, address) in procs.items()}, seconds))
        finally:
            for proc, _ in procs.values():
                proc.terminate()
                proc.wait(30)
    print(
        f"blockd gc, open loop at {figures['offered_admissions_per_s']} admissions/s, {seconds:.0f} s x 2 turns each: "
        f"tuned p50 {figures['tuned_step_p50_ms']} ms p99 {figures['tuned_step_p99_ms']} ms; CPython defaults "
        f"p50 {figures['default_step_p50_ms']} ms p99 {figures['default_step_p99_ms']} ms "
        f"(default / tuned p99 = {figures['default_over_tuned_p99']}x)"
    )
    return figures


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s per turn instead of 10 s")
    main(parser.parse_args().quick)
