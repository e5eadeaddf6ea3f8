"""Prometheus metrics of both daemons, scraped over HTTP, against what they must say.

blockd's prefix-cache counters and block gauges must equal GetStats (read with
nothing changing in between), pool by pool; their change over a workload must equal
the prompt and cached tokens the responses reported. Each computed's
requests-by-outcome counters must count the requests sent to it, finish reason by
finish reason (a cancelled stream included), and its time-to-first-token and step
histograms must have observed them.
"""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

from clients.client import BlockdClient, ComputedClient, KVCacheClient
from clients.types import Stats
from tests.scaleout.helpers import (
    BLOCK_SIZE,
    Samples,
    Stack,
    blockd_metrics_url,
    computed_metrics_url,
    labelled,
    random_tokens,
    sample,
    scrape,
)

SEED = 11

# GetStats field -> blockd metric (sample name), one sample per pool (label pool_id).
BLOCKD_METRICS = {
    "queried_tokens": "kvcache_prefix_cache_queries_total",
    "hit_tokens": "kvcache_prefix_cache_hits_total",
    "num_evictions": "kvcache_evictions_total",
    "num_admissions": "kvcache_admissions_total",
    "num_blocks": "kvcache_blocks",
    "num_free_blocks": "kvcache_free_blocks",
    "num_evictable_blocks": "kvcache_evictable_blocks",
    "num_referenced_blocks": "kvcache_referenced_blocks",
    "num_pinned_blocks": "kvcache_pinned_blocks",
    "num_cached_blocks": "kvcache_cached_blocks",
    "num_sequences": "kvcache_sequences",
}


@dataclass(frozen=True)
class Sent:
    worker: str
    outcome: str
    prompt_tokens: int
    cached_tokens: int
    tokens: tuple[int, ...]


def run_workload(stack: Stack, rng: random.Random) -> list[Sent]:
    """Ten requests over both workers (round robin, one at a time) on three shared
    prefixes, so some hit; then one long stream cancelled after its first token."""
    prefixes = [random_tokens(rng, 2 * BLOCK_SIZE + 5) for _ in range(3)]
    sent = []
    with KVCacheClient(stack.blockd.address, stack.worker_addresses, routing="round-robin") as client:
        for _ in range(10):
            tokens = rng.choice(prefixes) + random_tokens(rng, 4)
            done = client.complete(token_ids=tokens, max_tokens=rng.randrange(1, 6))
            sent.append(
                Sent(
                    done.worker_address,
                    done.finish_reason,
                    done.usage.prompt_tokens,
                    done.usage.cached_tokens,
                    tuple(tokens),
                )
            )
    tokens = random_tokens(rng, 20)
    with ComputedClient(stack.worker_b.address) as worker:
        stream = worker.generate(token_ids=tokens, max_tokens=100, ignore_eos=True)
        assert next(stream).token_ids
        stream.cancel()
    sent.append(Sent(stack.worker_b.address, "cancelled", len(tokens), 0, tuple(tokens)))
    return sent


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return sample(after, name, **labels) - sample(before, name, **labels)


def wait_for_sample(url: str, name: str, value: float, timeout: float = 10.0, **labels: str) -> None:
    deadline = time.monotonic() + timeout
    while (current := sample(scrape(url), name, **labels)) != value:
        assert time.monotonic() < deadline, f"{name}{labels} is {current}, expected {value}"
        time.sleep(0.05)


def test_metrics_match_stats_and_the_workload(stack: Stack) -> None:
    rng = random.Random(SEED)
    urls = {w.address: computed_metrics_url(w) for w in stack.workers}
    blockd_url = blockd_metrics_url(stack.blockd)
    stack.wait_idle()
    with stack.client() as client:
        before = {address: scrape(url) for address, url in urls.items()}
        blockd_before = client.get_stats()
        sent = run_workload(stack, rng)
        cancelled = sample(before[stack.worker_b.address], "computed_requests_total", outcome="cancelled")
        wait_for_sample(
            urls[stack.worker_b.address], "computed_requests_total", cancelled + 1, outcome="cancelled"
        )
        stack.wait_idle()
        after = {address: scrape(url) for address, url in urls.items()}

        for address in stack.worker_addresses:
            mine = [s for s in sent if s.worker == address]
            assert mine, f"round robin sent nothing to {address}"
            old, new = before[address], after[address]
            outcomes = {
                k: v - labelled(old, "computed_requests_total", "outcome").get(k, 0)
                for k, v in labelled(new, "computed_requests_total", "outcome").items()
            }
            assert {k: v for k, v in outcomes.items() if v} == Counter(s.outcome for s in mine), address
            ttft = "computed_time_to_first_token_seconds"
            assert delta(new, old, f"{ttft}_count") == len(mine)  # every request got a first token
            assert delta(new, old, f"{ttft}_sum") > 0
            assert sample(new, f"{ttft}_bucket", le="+Inf") == sample(new, f"{ttft}_count")
            steps = delta(new, old, "computed_step_seconds_count")
            assert steps > 0 and delta(new, old, "computed_step_seconds_sum") > 0
            assert steps == delta(new, old, "computed_steps_total")  # one observation per iteration
            # Only cache misses run through the model.
            assert delta(new, old, "computed_prefill_tokens_total") == sum(
                s.prompt_tokens - s.cached_tokens for s in mine
            )

        # blockd: the workload's tokens, as the responses reported them.
        blockd_after = client.get_stats()
        assert blockd_after.total.queried_tokens - blockd_before.total.queried_tokens == sum(
            s.prompt_tokens for s in sent
        )
        assert blockd_after.total.hit_tokens - blockd_before.total.hit_tokens == sum(
            s.cached_tokens for s in sent
        )

        # Pin the prefix of the last request that hit (still cached: nothing ran since), so the
        # pinned and referenced gauges are not all zero.
        hot = [s for s in sent if s.cached_tokens][-1]
        pin = client.pin(list(hot.tokens), ttl_seconds=60)
        try:
            assert pin.num_pinned_blocks > 0
            stats, metrics = stable_scrape(client, blockd_url)
            assert sum(p.num_pinned_blocks for p in stats.pools) > 0
            per_pool: dict[str, dict[str, float]] = defaultdict(dict)
            for field, name in BLOCKD_METRICS.items():
                for pool_id, value in labelled(metrics, name, "pool_id").items():
                    per_pool[pool_id][field] = value
            assert set(per_pool) == {p.pool_id for p in stats.pools}
            for pool in stats.pools:
                assert per_pool[pool.pool_id] == {f: getattr(pool, f) for f in BLOCKD_METRICS}, pool.pool_id
            live = sum(1 for p in client.list_pools() if p.is_live)
            assert sample(metrics, "kvcache_pools_live") == live
        finally:
            client.unpin(pin.pin_id)


def stable_scrape(client: BlockdClient, url: str) -> tuple[Stats, Samples]:
    """GetStats and a scrape with no change in between (equal GetStats on both sides)."""
    for _ in range(20):
        first = client.get_stats()
        metrics = scrape(url)
        if client.get_stats() == first:
            return first, metrics
    raise AssertionError("blockd's stats kept changing")
