"""Prometheus metrics for computed, read from the engine's counters at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from computed.engine import Engine

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histograms:
    """Histograms the engine feeds as things happen (counters are read from stats)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "computed_time_to_first_token_seconds",
            "Time to first token",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.step = Histogram(
            "computed_step_seconds", "Engine iteration wall time", buckets=STEP_BUCKETS, registry=registry
        )

    def on_step(self, seconds: float) -> None:
        self.step.observe(seconds)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)


class _EngineCollector:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        for name, doc, value in (
            (
                "computed_prefill_tokens",
                "Prompt positions run through the model (cache misses)",
                s.num_prefill_tokens,
            ),
            ("computed_decode_tokens", "Decode positions run through the model", s.num_decode_tokens),
            ("computed_steps", "Engine iterations", s.num_steps),
            (
                "computed_forwards",
                "Forward steps run (decode bursts run several an iteration)",
                s.num_forwards,
            ),
            ("computed_forward_seconds", "Seconds in forward passes", s.forward_seconds),
            (
                "computed_directory_wait_seconds",
                "Seconds the engine waited on blockd",
                s.directory_wait_seconds,
            ),
            ("computed_blockd_recoveries", "Re-registrations with blockd", s.num_recoveries),
            (
                "computed_host_tier_bytes_copied",
                "Bytes copied between the device pool and the host tier (demotions and loads)",
                s.num_bytes_copied,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        shared = self.engine.runner.shared if hasattr(self.engine.runner, "shared") else None
        if shared is not None:
            c = shared.store.counters
            for name, doc, value in (
                ("computed_shared_tier_blocks_written", "Blocks written to the shared tier", c.num_written),
                (
                    "computed_shared_tier_write_failures",
                    "Shared tier writes dropped (store down, slow or full)",
                    c.num_write_failures,
                ),
                ("computed_shared_tier_blocks_fetched", "Blocks fetched from the shared tier", c.num_fetched),
                (
                    "computed_shared_tier_fetch_misses",
                    "Shared tier fetches that found no valid value (gone, or a header mismatch)",
                    c.num_fetch_misses,
                ),
                (
                    "computed_shared_tier_fetch_errors",
                    "Shared tier fetches lost to a timeout or a connection error (recomputed)",
                    c.num_fetch_errors,
                ),
                ("computed_shared_tier_bytes_written", "Bytes written to the shared tier", c.bytes_written),
                ("computed_shared_tier_bytes_fetched", "Bytes fetched from the shared tier", c.bytes_fetched),
            ):
                yield CounterMetricFamily(name, doc, value=value)
        outcomes = CounterMetricFamily(
            "computed_requests", "Finished requests by outcome", labels=["outcome"]
        )
        for reason, count in sorted(s.finished.items()):
            outcomes.add_metric([reason], count)
        yield outcomes
        sched = self.engine.scheduler
        yield GaugeMetricFamily(
            "computed_requests_running", "Sequences holding blocks", value=len(sched.running)
        )
        yield GaugeMetricFamily(
            "computed_requests_waiting", "Sequences waiting for admission", value=len(sched.waiting)
        )


def serve_metrics(engine: Engine, port: int, registry: CollectorRegistry, host: str = "127.0.0.1") -> int:
    """Expose /metrics on `host`:`port` (0: any free port); returns the bound port."""
    registry.register(_EngineCollector(engine))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server.server_port
