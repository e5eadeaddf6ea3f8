"""Prometheus metrics, read from the directory at scrape time.

Names follow vLLM's prefix-cache metrics: queries and hits are counted in tokens.
The HTTP endpoint runs on the server's event loop (not in a thread), so a scrape
reads the directory between two RPCs, never during one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from blockd import native
from blockd.directory import BlockDirectory

log = structlog.get_logger("blockd.metrics")

_COUNTERS = (  # (metric name without _total, help, PoolStats field)
    ("kvcache_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "queried_tokens"),
    ("kvcache_prefix_cache_hits", "Prompt tokens served from the prefix cache", "hit_tokens"),
    ("kvcache_evictions", "Cached blocks evicted to make room", "num_evictions"),
    ("kvcache_admissions", "Sequences admitted", "num_admissions"),
    (
        "kvcache_admissions_deferred",
        "Admissions answered 'not now' for lack of blocks",
        "num_admissions_deferred",
    ),
)
_GAUGES = (
    ("kvcache_blocks", "Blocks in the pool", "num_blocks"),
    ("kvcache_free_blocks", "Free blocks", "num_free_blocks"),
    ("kvcache_evictable_blocks", "Cached blocks nobody references (evictable)", "num_evictable_blocks"),
    ("kvcache_referenced_blocks", "Blocks held by live sequences or pins", "num_referenced_blocks"),
    ("kvcache_pinned_blocks", "Blocks held by pins", "num_pinned_blocks"),
    ("kvcache_cached_blocks", "Blocks findable by hash", "num_cached_blocks"),
    ("kvcache_sequences", "Live sequences", "num_sequences"),
)


_HOST_COUNTERS = (  # (metric name without _total, help, TierStats field); label tier="host"
    ("kvcache_tier_hits", "Prompt tokens served from a lower tier (loaded)", "hit_tokens"),
    ("kvcache_tier_demotions", "Blocks copied into a lower tier on device eviction", "num_demotions"),
    ("kvcache_tier_loads", "Blocks copied from a lower tier into the device pool", "num_loads"),
    ("kvcache_tier_evictions", "Blocks dropped from a lower tier to make room", "num_evictions"),
    (
        "kvcache_tier_loads_skipped",
        "Lower-tier hits recomputed: the copy was estimated slower",
        "num_loads_skipped",
    ),
)
_HOST_GAUGES = (
    ("kvcache_tier_blocks", "Blocks of a lower tier", "num_blocks"),
    ("kvcache_tier_free_blocks", "Free blocks of a lower tier", "num_free_blocks"),
    (
        "kvcache_tier_evictable_blocks",
        "Resident blocks of a lower tier not being loaded",
        "num_evictable_blocks",
    ),
    ("kvcache_tier_referenced_blocks", "Blocks of a lower tier being loaded", "num_referenced_blocks"),
)


class DirectoryCollector(Collector):
    """One sample per pool (label pool_id) for each counter and gauge."""

    def __init__(self, directory: BlockDirectory) -> None:
        self._directory = directory

    def collect(self) -> Iterator[Metric]:
        stats = self._directory.stats().pools
        for name, help_text, field in _COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=["pool_id"])
            for pool in stats:
                family.add_metric([pool.pool_id or ""], getattr(pool, field))
            yield family
        for name, help_text, field in _GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=["pool_id"])
            for pool in stats:
                family.add_metric([pool.pool_id or ""], getattr(pool, field))
            yield family
        # One sample per pool and lower tier (tier="host", tier="shared"); for the shared
        # tier, demotions are blocks the pool wrote to the store, evictions records
        # dropped because a fetch found the value gone, and the block gauges count the
        # namespace's blocks in the store.
        tiers = [
            (pool.pool_id or "", name, tier)
            for pool in stats
            for name, tier in (("host", pool.host), ("shared", pool.shared))
            if tier is not None
        ]
        for families, kind in ((_HOST_COUNTERS, CounterMetricFamily), (_HOST_GAUGES, GaugeMetricFamily)):
            for name, help_text, field in families:
                family = kind(name, help_text, labels=["pool_id", "tier"])
                for pool_id, tier_name, tier in tiers:
                    family.add_metric([pool_id, tier_name], getattr(tier, field))
                yield family
        misses = CounterMetricFamily(
            "kvcache_prefix_cache_misses",
            "Admitted prompt tokens not served from the prefix cache, by reason (kvctl why)",
            labels=["pool_id", "reason"],
        )
        ghosts = GaugeMetricFamily(
            "kvcache_ghosts", "Block hashes remembered after they left the index", labels=["pool_id"]
        )
        for pool in stats:
            for reason, num_tokens in pool.miss_tokens:
                misses.add_metric([pool.pool_id or "", reason], num_tokens)
            ghosts.add_metric([pool.pool_id or ""], pool.num_ghosts)
        yield misses
        yield ghosts
        live = GaugeMetricFamily("kvcache_pools_live", "Pools whose lease is alive")
        live.add_metric([], sum(1 for info in self._directory.list_pools() if info.is_live))
        yield live
        core = GaugeMetricFamily(
            "kvcache_directory_core",
            "1 for the directory core this blockd runs: compiled (blockd.native) or pure",
            labels=["core"],
        )
        core.add_metric(["compiled" if native.is_enabled() else "pure"], 1)
        yield core


def make_registry(directory: BlockDirectory) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DirectoryCollector(directory))
    return registry


async def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> asyncio.Server:
    """A minimal HTTP/1.1 endpoint: GET /metrics answers the exposition format."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), timeout=5)
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (b"\r\n", b"\n", b""):
                pass  # headers are not needed
            parts = request_line.split()
            if len(parts) >= 2 and parts[0] == b"GET" and parts[1].split(b"?")[0] in (b"/metrics", b"/"):
                status, body, content_type = b"200 OK", generate_latest(registry), CONTENT_TYPE_LATEST
            else:
                status, body, content_type = b"404 Not Found", b"try GET /metrics\n", "text/plain"
            writer.write(
                b"HTTP/1.1 "
                + status
                + b"\r\nContent-Type: "
                + content_type.encode()
                + b"\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + body
            )
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        except Exception:
            log.exception("metrics scrape failed")
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)
