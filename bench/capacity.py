"""5. blockd capacity: the figures of bench.blockd_grpc, bench.blockd_fleet, bench.blockd_gc,
bench.blockd_inprocess and bench.blockd_core.

Each module's `main(quick)` answers a dict of figures; a module that is missing or
raises is reported as such in the table (this benchmark never raises for them).
"""

from __future__ import annotations

import importlib
import traceback

from bench.context import BenchContext
from bench.report import BenchResult, Figure, Goal

TITLE = "5. blockd capacity"

# (module, figure key, shown name, unit, goal) for the headline rows; all keys go to details.
HEADLINES = {
    "bench.blockd_grpc": [
        (
            "batched_admissions_per_s",
            "gRPC admissions/s, 4,096-token prompts, 8 workers",
            "/s",
            Goal(">=", 5000.0),
        ),
        (
            "packed_over_varint",
            "packed token_bytes + commit by index ÷ varint token_ids + commit with tokens (admissions/s)",
            "x",
            None,
        ),
        ("step_p50_ms", "gRPC Step p50 latency, closed loop (at the maximum)", "ms", None),
        ("step_p99_ms", "gRPC Step p99 latency, closed loop (at the maximum)", "ms", None),
        (
            "open_loop_offered_admissions_per_s",
            "open loop: offered admissions/s (half the maximum)",
            "/s",
            None,
        ),
        ("open_loop_step_p50_ms", "open loop: Step p50 latency", "ms", None),
        ("open_loop_step_p99_ms", "open loop: Step p99 latency", "ms", Goal("<=", 5.0)),
        (
            "transport_ceiling_admissions_per_s",
            "same client against an echo server (gRPC + client ceiling)",
            "/s",
            None,
        ),
        ("batched_over_ceiling", "blockd ÷ echo server (admissions/s)", "x", None),
        ("batched_over_naive", "batched Step ÷ one call per block (admissions/s)", "x", None),
        (
            "compiled_over_pure",
            "compiled directory core ÷ pure, gRPC admissions/s (side by side, in turns)",
            "x",
            None,
        ),
    ],
    "bench.blockd_fleet": [
        (
            "one_open_step_p99_ms",
            "fleet, 64 GPU workers at a GPU's rate, one blockd: Step p99",
            "ms",
            Goal("<=", 5.0),
        ),
        ("one_open_steps_per_s", "fleet, one blockd: Steps/s served (offered 4,480)", "/s", None),
        (
            "echo_open_step_p99_ms",
            "fleet, the same clients against an echo server (their own floor): Step p99",
            "ms",
            None,
        ),
        ("sharded_open_step_p99_ms", "fleet, 2 shards: Step p99", "ms", Goal("<=", 5.0)),
        ("one_closed_steps_per_s", "fleet, closed loop, one blockd: Steps/s", "/s", None),
        ("sharded_closed_steps_per_s", "fleet, closed loop, 2 shards: Steps/s", "/s", None),
        ("sharded_over_one_closed_steps", "fleet maximum, 2 shards ÷ one process", "x", Goal(">=", 1.8)),
    ],
    "bench.blockd_gc": [
        (
            "tuned_step_p99_ms",
            "open loop Step p99, gc tuned (young collections only, start-up heap frozen)",
            "ms",
            None,
        ),
        (
            "default_step_p99_ms",
            "open loop Step p99, CPython's gc defaults (same rate, in turns)",
            "ms",
            None,
        ),
    ],
    "bench.blockd_inprocess": [
        (
            "cpu_us_per_admission",
            "blockd Step path CPU per admission in process, the batched workers' Steps (no gRPC)",
            "µs",
            None,
        ),
        ("pure_cpu_us_per_admission", "the same, pure directory core", "µs", None),
        ("pure_over_compiled_cpu", "CPU per admission, pure ÷ compiled core", "x", None),
    ],
    "bench.blockd_core": [
        (
            "warm_packed_admit_release_us",
            "core admit+release, 4,096 tokens all hit, packed token bytes as computed sends them (median)",
            "µs",
            Goal("<=", 100.0),
        ),
        ("warm_admit_release_us", "the same, tokens as a Python list (median)", "µs", None),
        ("cold_admit_release_us", "core admit+release, 4,096 tokens all miss (median)", "µs", None),
        ("pure_warm_admit_release_us", "the same all-hit admit+release, pure directory core", "µs", None),
        ("varint_over_packed", "parse + convert one admission's Steps: varint ÷ packed", "x", None),
    ],
}


def run(ctx: BenchContext) -> BenchResult:
    figures: list[Figure] = []
    sections: list[str] = []
    for module_name, headlines in HEADLINES.items():
        try:
            module = importlib.import_module(module_name)
            data = module.main(ctx.quick)
        except Exception as exc:  # noqa: BLE001 - reported in the table, not raised
            traceback.print_exc()
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            figures.append(Figure(f"{module_name}", f"not measured ({reason})"))
            sections.append(f"`{module_name}.main({ctx.quick})` failed: `{reason}`")
            continue
        for key, name, unit, goal in headlines:
            value = data.get(key)
            figures.append(
                Figure(
                    name,
                    value if value is not None else f"missing key {key!r}",
                    unit,
                    goal if value is not None else None,
                )
            )
        table = ["| key | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in data.items()]
        sections.append(f"`{module_name}.main({ctx.quick})`: {_first_line(module)}\n\n" + "\n".join(table))
    details = (
        "Figures of the blockd benchmarks (their modules are owned by the blockd engineer; "
        "this harness only runs them). Absolute times follow the machine's load (two cores "
        "shared with other work); the echo server's ceiling, measured in the same run, is the "
        "reference for the admissions/s.\n\n" + "\n\n".join(sections)
    )
    return BenchResult("capacity", TITLE, figures, details)


def _first_line(module) -> str:
    doc = (module.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""
