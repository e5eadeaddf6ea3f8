"""What every benchmark gets: the mode, a scratch folder, where plots go, its command."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchContext:
    quick: bool
    workdir: Path  # scratch (daemon logs, models); removed after the run
    plot_dir: Path  # PNGs land here; BENCHMARKS.md links them relative to itself
    command: str  # reproduces this one benchmark
    # torch threads of every process that runs a model (computed and the transformers
    # baseline alike, so ratios compare like with like); None: torch's default.
    threads: int | None = None

    def scratch(self, name: str) -> Path:
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return path
