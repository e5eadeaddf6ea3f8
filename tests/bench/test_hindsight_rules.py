"""bench.hindsight_rules: its replay is blockd's leaf-first replay when ranked by recency,
and its rules rank what they say they do."""

from __future__ import annotations

from bench.belady import replay_belady
from bench.directory_replay import replay_directory
from bench.hindsight_rules import NEVER_KEEP, Rule, best_rule, class_oracle, grid, replay_ranked
from bench.retention_traces import conversation_spec, distinct_blocks, make_session_trace


def test_ranked_by_release_tick_it_is_blockds_lru_hit_for_hit():
    trace = make_session_trace(conversation_spec(600))
    pool = int(distinct_blocks(trace.prompts, 16) * 0.05)
    ours = replay_ranked(trace.prompts, pool, 16, lambda t, hits, fresh: t)
    blockd = replay_directory(trace.prompts, pool, 16, "lru")
    assert ours.hits == blockd.hits
    assert ours.num_evictions == blockd.num_evictions


def test_a_chain_ranked_to_stay_outlives_newer_ones():
    # a (4 blocks), then b and c (4 each) in a pool of 8: ranked by recency, a goes when c
    # arrives; ranked to stay, b goes instead and a's repeat hits.
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    trace = [a, b, c, a]
    recency = replay_ranked(trace, 8, 1, lambda t, hits, fresh: t)
    keep_first = replay_ranked(trace, 8, 1, lambda t, hits, fresh: t + (100 if t == 0 else 0))
    assert recency.hits[3] == 0
    assert keep_first.hits[3] == 4


def test_a_rule_sorts_requests_by_hit_prefix_and_fresh_run():
    rule = Rule(prefix_cut=2, run_cut=8, fresh_start=50, long_run=NEVER_KEEP, continuation=-5)
    assert rule.rank(10, 2, 8) == 60  # a fresh start
    assert rule.rank(10, 1, 9) == 10 + NEVER_KEEP  # a long fresh run
    assert rule.rank(10, 3, 1) == 5  # a continuation
    assert len(grid(full=True)) == 288
    assert set(grid(full=False)) <= set(grid(full=True))


def test_no_rule_nor_the_oracle_beats_the_offline_optimum():
    trace = make_session_trace(conversation_spec(600))
    pool = int(distinct_blocks(trace.prompts, 16) * 0.05)
    opt = replay_belady(trace.prompts, pool, 16).hit_tokens
    _, best = best_rule(trace.prompts, pool, 16, grid(full=False))
    oracle = replay_ranked(trace.prompts, pool, 16, class_oracle(trace.family_ids))
    lru = replay_ranked(trace.prompts, pool, 16, lambda t, hits, fresh: t)
    assert lru.hit_tokens <= best.hit_tokens <= opt
    assert oracle.hit_tokens <= opt
