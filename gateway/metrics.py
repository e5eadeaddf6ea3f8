"""The gateway's Prometheus metrics (GET /metrics), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry()

REQUESTS = Counter(
    "gateway_requests",
    "HTTP requests answered, by endpoint and status",
    ["endpoint", "status"],
    registry=REGISTRY,
)
TOKENS = Counter(
    "gateway_tokens",
    "Tokens by kind: prompt, cached (prompt tokens served from cache), completion",
    ["kind"],
    registry=REGISTRY,
)
ROUTING = Counter(
    "gateway_routing_decisions",
    "Where requests went: routed (to the longest cached prefix), spilled (load sent it to a worker "
    "caching less), least_loaded (fallback or single worker), round_robin",
    ["decision"],
    registry=REGISTRY,
)
INFLIGHT = Gauge("gateway_inflight_requests", "Generation requests being served", registry=REGISTRY)
# Seconds, for both views of the time to first token.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TTFT = Histogram(
    "gateway_time_to_first_token_seconds",
    "Time to first token as the workers measured it",
    buckets=TTFT_BUCKETS,
    registry=REGISTRY,
)
FIRST_CHUNK = Histogram(
    "gateway_time_to_first_chunk_seconds",
    "Received -> the first message of each of the request's generations is in (parsing, placement, "
    "gRPC both ways and the workers' admission and time to first token): the gateway's own view",
    buckets=TTFT_BUCKETS,
    registry=REGISTRY,
)
DISCONNECTS = Counter(
    "gateway_client_disconnects",
    "Streams whose client went away before the end (generation cancelled)",
    registry=REGISTRY,
)
TOKENIZED = Counter(
    "gateway_tokenizations",
    "Prompts tokenized to route them: local (--tokenizer) or worker (its Tokenize, after local declined)",
    ["where"],
    registry=REGISTRY,
)
ROUTE_SOURCE = Counter(
    "gateway_route_answers",
    "Where a routed request's cached-prefix facts came from: mirror (the gateway's mirror of "
    "blockd's index, fed by its event stream) or route (blockd's Route RPC, while the mirror is "
    "out of sync or does not know a worker)",
    ["source"],
    registry=REGISTRY,
)
MIRROR_SYNCED = Gauge(
    "gateway_directory_mirror_synced",
    "1 while the directory mirror follows blockd's events",
    registry=REGISTRY,
)
MIRROR_BLOCKS = Gauge(
    "gateway_directory_mirror_blocks",
    "Block hashes the directory mirror holds (all pools, tiers)",
    registry=REGISTRY,
)
