"""Prometheus metrics for computed, read from the engine's counters at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from computed.engine import Engine

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A request's phases before its first token run from well under a millisecond (admitting
# a token-id prompt) to seconds (a long queue).
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


class Histograms:
    """Histograms the engine feeds as things happen (counters are read from stats): a
    request's time to first token and its parts (the phases of EngineObserver), its
    total time and time per output token, and the engine's step time."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=registry)

        self.ttft = histogram(
            "computed_time_to_first_token_seconds",
            "Time to first token: queued in the engine -> first token (queue + prefill)",
            TTFT_BUCKETS,
        )
        self.admission = histogram(
            "computed_request_admission_seconds",
            "Received -> queued in the engine: parsing, tokenization, checks",
            PHASE_BUCKETS,
        )
        self.queue = histogram(
            "computed_request_queue_seconds",
            "Queued in the engine -> its first forward starts (a slot, blockd's answer, the step in progress)",
            PHASE_BUCKETS,
        )
        self.prefill = histogram(
            "computed_request_prefill_seconds",
            "Its first forward starts -> its first token (every chunk of an uncached prompt)",
            PHASE_BUCKETS,
        )
        self.total = histogram(
            "computed_request_seconds", "Queued in the engine -> its last token", REQUEST_BUCKETS
        )
        self.per_token = histogram(
            "computed_time_per_output_token_seconds",
            "Mean time per output token after the first, per request of two or more",
            PER_TOKEN_BUCKETS,
        )
        self.step = histogram("computed_step_seconds", "Engine iteration wall time", STEP_BUCKETS)

    def on_step(self, seconds: float) -> None:
        self.step.observe(seconds)

    def on_admission(self, seconds: float) -> None:
        self.admission.observe(seconds)

    def on_queued(self, seconds: float) -> None:
        self.queue.observe(seconds)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_prefill(self, seconds: float) -> None:
        self.prefill.observe(seconds)

    def on_finished(self, seconds: float, per_output_token: float | None) -> None:
        self.total.observe(seconds)
        if per_output_token is not None:
            self.per_token.observe(per_output_token)


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
