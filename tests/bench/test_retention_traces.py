"""The eviction benchmark's session and few-shot traces: seeded, and shaped as their
docstrings say (bench.retention_traces)."""

from __future__ import annotations

from collections import Counter

from bench.prefix_keys import PrefixKeys
from bench.retention_traces import (
    FewShotSpec,
    agent_spec,
    conversation_spec,
    make_few_shot_trace,
    make_session_trace,
)
from bench.trace_statistics import trace_statistics


def _block_uses(prompts: list[list[int]]) -> Counter[int]:
    keys = PrefixKeys(16)
    return Counter(key for prompt in prompts for key in keys.chain(prompt))


def test_session_traces_are_seeded():
    for spec in (agent_spec(200), conversation_spec(200)):
        assert make_session_trace(spec).prompts == make_session_trace(spec).prompts
    assert make_session_trace(agent_spec(200, seed=1)).prompts != make_session_trace(agent_spec(200)).prompts


def test_a_session_step_extends_its_previous_request():
    trace = make_session_trace(conversation_spec(600))
    last: dict[int, list[int]] = {}
    num_steps = 0
    for prompt, shared, family in zip(trace.prompts, trace.shared_tokens, trace.family_ids):
        if family in last:
            before = last[family]
            assert prompt[: len(before)] == before and shared > len(before), "history + reply + new turn"
            num_steps += 1
        if family >= 0:
            last[family] = prompt
    assert num_steps > 100


def test_agent_trace_is_mostly_one_offs_with_long_gaps():
    trace = make_session_trace(agent_spec(1_000))
    assert 0.3 < trace.family_ids.count(-1) / len(trace.prompts) < 0.6  # 60% of new work
    uses = _block_uses(trace.prompts)
    assert sum(1 for n in uses.values() if n == 1) / len(uses) > 0.5
    # a session's steps are far apart: more requests between them than a session has steps
    seen: dict[int, int] = {}
    gaps = []
    for i, family in enumerate(trace.family_ids):
        if family >= 0:
            if family in seen:
                gaps.append(i - seen[family])
            seen[family] = i
    assert sorted(gaps)[len(gaps) // 2] > 50


def test_few_shot_trace_reuses_every_block():
    trace = make_few_shot_trace(FewShotSpec(num_requests=4_000))  # the benchmark's size
    uses = _block_uses(trace.prompts)
    assert sum(1 for n in uses.values() if n == 1) / len(uses) < 0.01
    assert len(set(map(tuple, trace.prompts))) <= 48 * 12


def test_conversation_trace_matches_the_published_statistics():
    # issue 44's production conversation trace: ~76% one-off blocks, median reuse gap
    # ~6,000 blocks (longer than a 2% pool), twice-used blocks ~42% of hits
    stats = trace_statistics(make_session_trace(conversation_spec(4_000)).prompts, 16)  # the benchmark's size
    assert 0.72 < stats.one_off_share < 0.80
    assert stats.median_reuse_gap is not None and 5_000 < stats.median_reuse_gap < 7_000
    assert stats.median_reuse_gap > 0.02 * stats.num_distinct
    assert 0.38 < stats.twice_used_hit_share < 0.46


def test_trace_statistics_count_one_offs_gaps_and_twice_used_hits():
    a, b, c = [1] * 16, [2] * 16, [3] * 16
    # blocks: a (3 uses), a+b (2 uses), a+c (1 use); requests of blocks: 0 1 | 2 3 | 4 5
    stats = trace_statistics([a + b, a + b, a + c], 16)
    assert stats.num_distinct == 3 and stats.num_requests == 6
    assert stats.one_off_share == 1 / 3
    assert stats.median_reuse_gap == 2  # a: 0->2->4, a+b: 1->3
    assert stats.twice_used_hit_share == 1 / 3  # hits: a twice, a+b once
