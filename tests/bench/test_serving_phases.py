"""bench.serving_http's breakdown of our time to first token: computed's phase histograms
scraped around a run, as each phase's mean per request of that run."""

from __future__ import annotations

import math

import pytest

from bench.serving_http import GATEWAY_PHASES, PHASES, PHASES_KEY, phases_table, worker_phases


def scrape(per_phase: dict[str, tuple[float, float]]) -> dict[str, float]:
    """A scrape: metric -> (count, sum)."""
    out = {}
    for metric, (count, total) in per_phase.items():
        out[metric + "_count"], out[metric + "_sum"] = count, total
    return out


def test_each_phase_is_the_runs_mean_not_the_daemons_lifetime_mean() -> None:
    before = scrape({m: (10.0, 5.0) for m in PHASES.values()})  # an earlier run: 0.5 s each
    after = scrape(
        {
            PHASES["admission"]: (14.0, 5.0 + 4 * 0.002),
            PHASES["queue"]: (14.0, 5.0 + 4 * 0.010),
            PHASES["prefill"]: (14.0, 5.0 + 4 * 0.020),
            PHASES["worker TTFT"]: (14.0, 5.0 + 4 * 0.030),
        }
    )
    phases = worker_phases(before, after)
    assert phases == {
        "admission": pytest.approx(2.0),
        "queue": pytest.approx(10.0),
        "prefill": pytest.approx(20.0),
        "worker TTFT": pytest.approx(30.0),
    }


def test_a_phase_nothing_reached_is_nan_and_the_table_shows_only_runs_with_phases() -> None:
    before = scrape({m: (0.0, 0.0) for m in PHASES.values()})
    after = scrape({**{m: (2.0, 0.1) for m in PHASES.values()}, PHASES["admission"]: (0.0, 0.0)})
    phases = worker_phases(before, after)
    assert math.isnan(phases["admission"]) and phases["queue"] == pytest.approx(50.0)
    ours = {"mean_ttft_ms": 61.25, PHASES_KEY: phases}
    table = phases_table([("shared, bfloat16", ours, {}), ("unrelated, bfloat16", {"mean_ttft_ms": 1.0}, {})])
    lines = table.splitlines()
    assert len(lines) == 3, table  # header, rule, the one run that has phases
    # No gateway figure in this run: its column shows nan, the worker's follow in order.
    assert lines[2].startswith("| shared, bfloat16 | 61.2 | nan | nan | 50.0 |"), table


def test_the_gateways_view_comes_from_its_own_metric_before_the_workers_phases() -> None:
    metric = GATEWAY_PHASES["gateway: received -> first chunk"]
    gateway = worker_phases(
        scrape({metric: (3.0, 0.3)}), scrape({metric: (5.0, 0.3 + 2 * 0.080)}), GATEWAY_PHASES
    )
    assert gateway == {"gateway: received -> first chunk": pytest.approx(80.0)}
    worker = worker_phases(
        scrape({m: (0.0, 0.0) for m in PHASES.values()}), scrape({m: (2.0, 0.1) for m in PHASES.values()})
    )
    ours = {"mean_ttft_ms": 100.0, PHASES_KEY: {**gateway, **worker}}
    header, _, row = phases_table([("shared, float32", ours, {})]).splitlines()
    assert header.index("gateway: received -> first chunk") < header.index("worker: admission"), header
    assert row == "| shared, float32 | 100.0 | 80.0 | 50.0 | 50.0 | 50.0 | 50.0 |", row
