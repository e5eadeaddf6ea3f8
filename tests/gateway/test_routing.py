"""Routing policies (gateway.routing): pure picks from cached tokens and load."""

from __future__ import annotations

import pytest

from gateway.routing import (
    POLICIES,
    CacheAware,
    Candidate,
    LeastLoaded,
    LongestPrefix,
    RoundRobin,
    make_policy,
)

PROMPT = 500  # tokens: a 480-token family prefix and a question


def test_registry_names_every_policy() -> None:
    assert set(POLICIES) == {"cache-aware", "prefix", "least-loaded", "round-robin"}
    assert isinstance(make_policy("cache-aware"), CacheAware)
    with pytest.raises(ValueError, match="round-robin"):
        make_policy("random")


def test_round_robin_takes_turns_whatever_the_cache() -> None:
    policy = RoundRobin()
    workers = [Candidate(480, 0), Candidate(0, 9)]
    assert [policy.pick(PROMPT, workers) for _ in range(4)] == [0, 1, 0, 1]


def test_least_loaded_ignores_the_cache_and_takes_the_first_among_equals() -> None:
    assert LeastLoaded().pick(PROMPT, [Candidate(480, 2), Candidate(0, 1)]) == 1
    assert LeastLoaded().pick(PROMPT, [Candidate(0, 1), Candidate(480, 1)]) == 0


def test_prefix_sticks_to_the_cache_however_long_its_queue() -> None:
    assert LongestPrefix().pick(PROMPT, [Candidate(0, 0), Candidate(480, 3, 3, 1500)]) == 1


def test_cache_aware_goes_where_the_prefix_is_when_queues_are_equal() -> None:
    # worker 0: nothing cached; worker 1: the family's prefix; both idle
    assert CacheAware().pick(PROMPT, [Candidate(0, 0), Candidate(480, 0)]) == 1


def test_cache_aware_stays_with_the_prefix_while_its_queue_costs_less_than_the_prefix_saves() -> None:
    # worker 1 holds the prefix and has two requests decoding (2 x 4 tokens of shared steps)
    # against 480 tokens of prefill on the idle worker 0
    workers = [Candidate(0, 0), Candidate(480, 2)]
    assert CacheAware().cost(PROMPT, workers[1]) == 2 * 4 + 20
    assert CacheAware().pick(PROMPT, workers) == 1


def test_cache_aware_spills_a_hot_prefix_when_its_worker_is_swamped() -> None:
    # worker 1 holds the prefix but two misses wait there for 1,000 tokens of prefill
    # and one decodes: 1,000 + 4 + 20 > 500 on the idle worker 0
    workers = [Candidate(0, 0), Candidate(480, 3, num_waiting=2, queued_prefill_tokens=1000)]
    assert CacheAware().pick(PROMPT, workers) == 0


def test_cache_aware_without_route_is_least_work_then_first() -> None:
    workers = [Candidate(0, 2), Candidate(0, 1), Candidate(0, 1)]
    assert CacheAware().pick(PROMPT, workers) == 1
    # queued prefill counts, not only the number of requests
    workers = [Candidate(0, 1, 1, 900), Candidate(0, 2)]
    assert CacheAware().pick(PROMPT, workers) == 1


def test_cache_aware_breaks_cost_ties_by_the_longer_prefix() -> None:
    # equal cost: worker 0 is idle and caches nothing (500); worker 1 caches 480 but 480
    # tokens of prefill wait there (480 + 20)
    workers = [Candidate(0, 0), Candidate(480, 1, 1, 480)]
    assert CacheAware().pick(PROMPT, workers) == 1


def test_cache_aware_decode_cost_is_a_setting() -> None:
    workers = [Candidate(0, 0), Candidate(480, 4)]
    assert CacheAware().pick(PROMPT, workers) == 1  # 4 x 4 + 20 < 500
    assert CacheAware(decode_cost_tokens=200).pick(PROMPT, workers) == 0  # 800 + 20 > 500
