"""Result types of the harness and how they are shown: one rich table, one markdown file.

A benchmark answers a `BenchResult`: figures (each with its goal, if it has one),
free-form markdown details, plots, and the command that reproduces it. Results are
kept as JSON (`results.json` beside the plots) so `--only NAME` re-renders the whole
BENCHMARKS.md with one section replaced.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

# "==" means equal at two decimals, as goals like "1.00" are written.
OPS = {"<=": lambda v, t: v <= t, ">=": lambda v, t: v >= t, "==": lambda v, t: abs(v - t) < 0.005}


@dataclass(frozen=True)
class Goal:
    """`value op target`, e.g. Goal("<=", 0.05)."""

    op: str
    target: float

    def __post_init__(self) -> None:
        assert self.op in OPS, f"goal op must be one of {sorted(OPS)}, got {self.op!r}"

    def is_met(self, value: float) -> bool:
        return OPS[self.op](value, self.target)

    def __str__(self) -> str:
        symbol = {"<=": "≤", ">=": "≥", "==": "="}[self.op]
        return f"{symbol} {self.target:.2f}" if self.op == "==" else f"{symbol} {_fmt(self.target)}"


@dataclass(frozen=True)
class Figure:
    """One reported number (or a word, e.g. "skipped"), with its goal when it has one."""

    name: str
    value: float | int | str
    unit: str = ""
    goal: Goal | None = None

    @property
    def is_met(self) -> bool | None:
        if self.goal is None or not isinstance(self.value, (int, float)):
            return None
        return self.goal.is_met(float(self.value))

    @property
    def shown(self) -> str:
        return f"{_fmt(self.value)}{' ' + self.unit if self.unit else ''}"


@dataclass
class BenchResult:
    key: str  # the --only name
    title: str
    figures: list[Figure] = field(default_factory=list)
    details: str = ""  # markdown: workload, method, per-case tables
    plots: list[str] = field(default_factory=list)  # file names beside BENCHMARKS.md's plots
    command: str = ""
    machine: dict = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None  # the harness failed to measure (traceback's last line)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> BenchResult:
        figures = [
            Figure(f["name"], f["value"], f.get("unit", ""), Goal(**f["goal"]) if f.get("goal") else None)
            for f in data.pop("figures")
        ]
        return cls(figures=figures, **data)


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or "unknown"
    try:  # a VM may say only "AMD EPYC": family, model and vector width tell its generation
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "cpu family", "model", "flags"):
                fields.setdefault(key.strip(), value.strip())
        if "model name" in fields:
            width = "AVX-512" if "avx512f" in fields.get("flags", "").split() else "no AVX-512"
            cpu = f"{fields['model name']} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}, {width})"
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def machine_line(info: dict) -> str:
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ", no GPU"
    return (
        f"{info.get('cpu')}, {info.get('cores')} cores{gpu}; torch {info.get('torch')} "
        f"({info.get('torch_threads')} thread(s) per model process), Python {info.get('python')}, {info.get('os')}"
    )


def _fmt(value: float | str) -> str:
    if isinstance(value, (bool, str)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    if abs(value) >= 0.01:
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return f"{value:.2g}"


def _status(figure: Figure) -> str:
    met = figure.is_met
    return "" if met is None else ("met" if met else "MISSED")


# ---------------------------------------------------------------- console


def print_table(results: list[BenchResult], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="Benchmarks", show_lines=False)
    for column in ("benchmark", "figure", "value", "goal", "status"):
        table.add_column(column, overflow="fold")
    for result in results:
        if result.error is not None:
            table.add_row(result.key, "error", result.error, "", "[red]ERROR[/red]")
            continue
        for i, figure in enumerate(result.figures):
            status = _status(figure)
            colour = {"met": "green", "MISSED": "red"}.get(status)
            table.add_row(
                result.key if i == 0 else "",
                figure.name,
                figure.shown,
                str(figure.goal) if figure.goal else "",
                f"[{colour}]{status}[/{colour}]" if colour else status,
            )
        table.add_section()
    console.print(table)


# ---------------------------------------------------------------- markdown


def save_results(path: Path, results: list[BenchResult]) -> None:
    """Merge into the stored results (by key), keeping the order of `order` later."""
    stored = load_results(path)
    for result in results:
        stored[result.key] = result
    path.write_text(json.dumps({k: r.to_json() for k, r in stored.items()}, indent=1) + "\n")


def load_results(path: Path) -> dict[str, BenchResult]:
    if not path.is_file():
        return {}
    return {key: BenchResult.from_json(data) for key, data in json.loads(path.read_text()).items()}


def render_markdown(results: list[BenchResult], plot_dir: str, header: str) -> str:
    lines = [
        header,
        "",
        "## Summary",
        "",
        "| benchmark | figure | value | goal | status |",
        "|---|---|---|---|---|",
    ]
    for result in results:
        if result.error is not None:
            lines.append(f"| [{result.key}](#{_anchor(result)}) | error | {_cell(result.error)} | | ERROR |")
            continue
        for i, figure in enumerate(result.figures):
            name = f"[{result.key}](#{_anchor(result)})" if i == 0 else ""
            lines.append(
                f"| {name} | {_cell(figure.name)} | {_cell(figure.shown)} | "
                f"{figure.goal or ''} | {_status(figure)} |"
            )
    for result in results:
        lines += [
            "",
            f"## {result.title}",
            "",
            f"Reproduce: `{result.command}` ({result.seconds:.0f} s on {machine_line(result.machine)})",
            "",
        ]
        if result.error is not None:
            lines += [f"**The harness failed:** `{result.error}`", ""]
        else:
            lines += ["| figure | value | goal | status |", "|---|---|---|---|"]
            lines += [
                f"| {_cell(f.name)} | {_cell(f.shown)} | {f.goal or ''} | {_status(f)} |"
                for f in result.figures
            ]
            lines.append("")
        if result.details:
            lines += [result.details.strip(), ""]
        for plot in result.plots:
            lines += [f"![{result.key}]({plot_dir}/{plot})", ""]
    return "\n".join(lines).rstrip() + "\n"


def _anchor(result: BenchResult) -> str:
    text = result.title.lower()
    keep = "".join(c for c in text if c.isalnum() or c in " -_")
    return keep.replace(" ", "-")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
