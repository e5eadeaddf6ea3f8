"""Fast checks of the benchmark harness's pure pieces: simulators, trace, report."""

from __future__ import annotations

import pytest

from bench.belady import replay_belady
from bench.directory_replay import replay_directory
from bench.prefix_keys import PrefixKeys
from bench.report import BenchResult, Figure, Goal, load_results, render_markdown, save_results
from bench.vllm_policy import replay_vllm
from bench.zipf_trace import TraceSpec, make_trace

# block_size 1: every token is a block. Pool of 4 blocks.
#   t0 [1 2]  t1 [3 4]  t2 [5 6]: the pool is full, two blocks must go
#   t3 [1 2]  t4 [3 4]
# Belady evicts the chain used last (3 4), so t3 hits 2 blocks; LRU and vLLM-style
# evict the least recently released chain (1 2) and then thrash: no hit at all.
THRASH = [[1, 2], [3, 4], [5, 6], [1, 2], [3, 4]]


def test_belady_keeps_the_chain_used_soonest():
    assert replay_belady(THRASH, 4, 1).hit_tokens == 2


@pytest.mark.parametrize("replay", [replay_directory, replay_vllm], ids=["directory-lru", "vllm-style"])
def test_recency_policies_thrash_where_belady_does_not(replay):
    result = replay(THRASH, 4, 1)
    assert result.hit_tokens == 0
    assert result.queried_tokens == 10


def test_a_repeated_prompt_hits_its_full_blocks_in_every_replay():
    trace = [list(range(40)), list(range(40))]  # 2 full blocks of 16 + a tail of 8
    for replay in (replay_belady, replay_vllm, replay_directory):
        assert replay(trace, 8, 16).hit_tokens == 32, replay.__name__


def test_belady_only_hits_whole_prefixes():
    # t1 shares block [1] with t0 but not block [2]: only one block hits, and t2's
    # block [9] never hits because its parent [8] differs from t0's [1].
    trace = [[1, 2, 3], [1, 7], [8, 2, 3]]
    assert replay_belady(trace, 16, 1).hit_tokens == 1


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("pool", [48, 96])
def test_no_policy_beats_the_offline_optimum(seed, pool):
    spec = TraceSpec(
        num_requests=300,
        num_families=20,
        num_apps=4,
        app_tokens=(8, 64),
        family_tokens=(16, 256),
        suffix_tokens=(4, 32),
        seed=seed,
    )
    trace = make_trace(spec).prompts
    opt = replay_belady(trace, pool, 16).hit_tokens
    assert opt > 0
    for hits in (
        replay_directory(trace, pool, 16, "lru").hit_tokens,
        replay_directory(trace, pool, 16, "lfu").hit_tokens,
        replay_vllm(trace, pool, 16).hit_tokens,
    ):
        assert hits <= opt


def test_trace_is_seeded_and_families_share_prefixes():
    spec = TraceSpec(num_requests=200, num_families=10, seed=3)
    a, b = make_trace(spec), make_trace(spec)
    assert a == b
    assert all(len(p) > shared for p, shared in zip(a.prompts, a.shared_tokens))
    prefixes = {tuple(p[:shared]) for p, shared in zip(a.prompts, a.shared_tokens)}
    assert len(prefixes) <= 10


def test_prefix_keys_depend_on_the_whole_prefix():
    keys = PrefixKeys(2)
    assert keys.chain([1, 2, 3, 4, 5]) == keys.chain([1, 2, 3, 4, 9])  # the tail has no key
    assert keys.chain([1, 2, 3, 4])[1] != keys.chain([0, 2, 3, 4])[1]
    assert keys.num_blocks(5) == 3


def test_goals():
    assert Goal("<=", 0.05).is_met(0.05) and not Goal("<=", 0.05).is_met(0.051)
    assert Goal(">=", 5.0).is_met(5.2) and not Goal(">=", 5.0).is_met(4.9)
    assert Goal("==", 1.0).is_met(1.004) and not Goal("==", 1.0).is_met(1.01)
    assert Figure("x", 0.5, "", Goal("<=", 0.05)).is_met is False
    assert Figure("x", "skipped", "", Goal("<=", 0.05)).is_met is None


def test_results_round_trip_and_render(tmp_path):
    store = tmp_path / "results.json"
    first = BenchResult("a", "A title", [Figure("ratio", 0.5, "", Goal("<=", 1.0))], "details", ["a.png"])
    save_results(store, [first, BenchResult("b", "B", error="RuntimeError: boom")])
    save_results(store, [BenchResult("a", "A again", [Figure("ratio", 2.0, "", Goal("<=", 1.0))])])
    stored = load_results(store)
    assert stored["a"].title == "A again" and stored["b"].error == "RuntimeError: boom"
    text = render_markdown(list(stored.values()), "results", "# Benchmarks")
    assert "| ratio | 2.00 | ≤ 1.00 | MISSED |" in text
    assert "ERROR" in text
