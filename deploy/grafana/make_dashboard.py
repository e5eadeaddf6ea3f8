"""Writes deploy/k8s/base/grafana-dashboard.json (the Grafana dashboard of the exported metrics).

    python deploy/grafana/make_dashboard.py

Every expression names metrics that gateway/metrics.py, computed/metrics.py and
blockd/metrics.py export (tests/deploy/test_manifests.py checks it).
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "k8s" / "base" / "grafana-dashboard.json"
RATE = "[5m]"

# (title, unit, [(expression, legend)])
PANELS = [
    (
        "Prompt tokens served from cache (hit rate, all pools)",
        "percentunit",
        [
            (
                f"sum(rate(kvcache_prefix_cache_hits_total{RATE})) / sum(rate(kvcache_prefix_cache_queries_total{RATE}))",
                "served from cache",
            ),
        ],
    ),
    (
        "Hit rate by lower tier (tokens loaded from it / tokens looked up)",
        "percentunit",
        [
            (
                f"sum by (tier) (rate(kvcache_tier_hits_total{RATE})) / scalar(sum(rate(kvcache_prefix_cache_queries_total{RATE})))",
                "{{tier}}",
            ),
        ],
    ),
    (
        "Hit rate by pool",
        "percentunit",
        [
            (
                f"sum by (pool_id) (rate(kvcache_prefix_cache_hits_total{RATE})) / sum by (pool_id) (rate(kvcache_prefix_cache_queries_total{RATE}))",
                "{{pool_id}}",
            ),
        ],
    ),
    (
        "Cache misses by reason (blocks/s)",
        "short",
        [(f"sum by (reason) (rate(kvcache_prefix_cache_misses_total{RATE}))", "{{reason}}")],
    ),
    (
        "Time to first token (gateway and workers)",
        "s",
        [
            (
                f"histogram_quantile(0.5, sum by (le) (rate(gateway_time_to_first_token_seconds_bucket{RATE})))",
                "gateway p50",
            ),
            (
                f"histogram_quantile(0.95, sum by (le) (rate(gateway_time_to_first_token_seconds_bucket{RATE})))",
                "gateway p95",
            ),
            (
                f"histogram_quantile(0.95, sum by (le) (rate(computed_time_to_first_token_seconds_bucket{RATE})))",
                "computed p95",
            ),
            (
                f"histogram_quantile(0.95, sum by (le) (rate(gateway_time_to_first_chunk_seconds_bucket{RATE})))",
                "gateway's own view (received -> first message in) p95",
            ),
        ],
    ),
    (
        "Engine step time",
        "s",
        [
            (
                f"histogram_quantile(0.5, sum by (le) (rate(computed_step_seconds_bucket{RATE})))",
                "p50",
            ),
            (
                f"histogram_quantile(0.95, sum by (le) (rate(computed_step_seconds_bucket{RATE})))",
                "p95",
            ),
        ],
    ),
    (
        "Time to first token by phase (workers, mean per request)",
        "s",
        [
            (
                (
                    f"sum(rate(computed_request_{phase}_seconds_sum{RATE})) "
                    f"/ sum(rate(computed_request_{phase}_seconds_count{RATE}))"
                ),
                legend,
            )
            for phase, legend in (
                ("admission", "admission (tokenize, check)"),
                ("queue", "queue (slot, blockd, step in progress)"),
                ("prefill", "prefill"),
            )
        ],
    ),
    (
        "Time per output token (workers)",
        "s",
        [
            (
                f"histogram_quantile({q}, sum by (le) (rate(computed_time_per_output_token_seconds_bucket{RATE})))",
                f"p{round(q * 100)}",
            )
            for q in (0.5, 0.95)
        ],
    ),
    (
        "Directory wait per step (blockd Step as the workers wait for it)",
        "s",
        [
            (
                f"sum(rate(computed_directory_wait_seconds_total{RATE})) / sum(rate(computed_steps_total{RATE}))",
                "seconds per step",
            )
        ],
    ),
    (
        "Requests",
        "reqps",
        [
            (f"sum by (status) (rate(gateway_requests_total{RATE}))", "HTTP {{status}}"),
            (f"sum by (outcome) (rate(computed_requests_total{RATE}))", "computed {{outcome}}"),
        ],
    ),
    (
        "Load",
        "short",
        [
            ("sum(gateway_inflight_requests)", "gateway in flight"),
            ("sum(computed_requests_running)", "running"),
            ("sum(computed_requests_waiting)", "waiting"),
            ("sum(kvcache_pools_live)", "live pools (workers)"),
        ],
    ),
    (
        "Routing decisions",
        "reqps",
        [(f"sum by (decision) (rate(gateway_routing_decisions_total{RATE}))", "{{decision}}")],
    ),
    (
        "Tokens through the model",
        "short",
        [
            (f"sum(rate(computed_prefill_tokens_total{RATE}))", "prefill (misses)"),
            (f"sum(rate(computed_decode_tokens_total{RATE}))", "decode"),
            (f'sum(rate(gateway_tokens_total{{kind="cached"}}{RATE}))', "prompt tokens from cache"),
        ],
    ),
    (
        "Pool blocks",
        "short",
        [
            ("sum(kvcache_free_blocks)", "free"),
            ("sum(kvcache_evictable_blocks)", "evictable"),
            ("sum(kvcache_referenced_blocks)", "referenced"),
            (f"sum(rate(kvcache_evictions_total{RATE}))", "evictions/s"),
        ],
    ),
]


def panel(index: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def dashboard() -> dict:
    return {
        "uid": "kvcache",
        "title": "kvcache: prefix cache fleet",
        "tags": ["kvcache"],
        "timezone": "browser",
        "schemaVersion": 39,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}
            ]
        },
        "panels": [panel(i, *spec) for i, spec in enumerate(PANELS)],
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
