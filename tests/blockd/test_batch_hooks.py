"""The batch hooks the pool calls once per chain or commit run (`evicted_many`,
`recall_many`) must leave exactly the state the per-block calls leave, bit for bit:
otherwise a pool's eviction decisions would depend on which path it took."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockd.block import Block
from blockd.eviction import POLICY_NAMES, AdaptivePolicy, EvictionPolicy, GatedPolicy, SeenTwice, make_policy
from blockd.ghosts import FLUSH, NOT_STORED, GhostTable
from tests.blockd.invariants import attributes

# ---------------------------------------------------------------- evicted_many


def _block(tick: int, seen: int, hits: int, retention: int, run_length: int) -> Block:
    block = Block(0, b"h" * 16, None, b"", None, b"", run_length=run_length, num_seen=seen)
    block.last_tick, block.num_hits, block.retention = tick, hits, retention
    return block


def _state(policy: EvictionPolicy) -> dict:
    """Every attribute of the policy (and of the policies it wraps), floats exact."""
    if isinstance(policy, SeenTwice):
        return {"seen2": _state(policy.inner)}
    state = {key: value for key, value in attributes(policy).items() if key not in ("inner", "_leader")}
    if isinstance(policy, GatedPolicy):
        state["inner"] = _state(policy.inner)
    return state


_blocks = st.tuples(
    st.integers(0, 5_000),  # last_tick
    st.integers(0, 3),  # num_seen
    st.integers(0, 4),  # num_hits
    st.sampled_from([0, 0, 1, 35, 80, 100]),  # retention
    st.integers(0, 200),  # run_length
)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("priority"), _blocks),
        st.tuples(st.just("evicted"), st.integers(0, 10_000)),
        st.tuples(st.just("evicted_many"), st.integers(0, 10_000), st.integers(0, 200)),
        st.tuples(st.just("returned"), st.integers(1, 7), st.integers(0, 200)),
    ),
    max_size=60,
)
_probe = [_block(tick, seen, hits, retention, run) for tick, seen, hits, retention, run in
          [(0, 1, 0, 0, 0), (50, 1, 0, 0, 3), (900, 1, 0, 0, 100), (900, 2, 0, 0, 0),
           (3_000, 1, 3, 0, 0), (4_000, 3, 6, 80, 0), (5_000, 1, 0, 1, 64)]]  # fmt: skip


def _replay(name: str, ops: list[tuple]) -> None:
    batched, one_by_one = make_policy(name), make_policy(name)
    priorities = [batched.priority(_block(0, 1, 0, 0, 0))]
    assert one_by_one.priority(_block(0, 1, 0, 0, 0)) == priorities[0]
    for op in ops:
        if op[0] == "priority":
            block = _block(*op[1])
            priority = batched.priority(block)
            assert one_by_one.priority(block) == priority
            priorities.append(priority)
        elif op[0] == "evicted":
            priority = priorities[op[1] % len(priorities)]
            batched.evicted(priority)
            one_by_one.evicted(priority)
        elif op[0] == "evicted_many":
            priority, num = priorities[op[1] % len(priorities)], op[2]
            batched.evicted_many(priority, num)
            for _ in range(num):
                one_by_one.evicted(priority)
        else:
            batched.returned(op[1], op[2])
            one_by_one.returned(op[1], op[2])
        assert _state(batched) == _state(one_by_one), op
    assert [batched.priority(block) for block in _probe] == [one_by_one.priority(block) for block in _probe]
    assert _state(batched) == _state(one_by_one)


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=60, deadline=None)
@given(ops=_ops)
def test_evicted_many_leaves_the_state_of_one_evicted_each(name, ops):
    _replay(name, ops)


@pytest.mark.parametrize("name", ["adaptive", "adaptive-ungated", "adaptive+seen2"])
@settings(max_examples=40, deadline=None)
@given(ops=_ops)
def test_evicted_many_splits_a_batch_where_the_counters_renormalise(name, ops):
    # every ~40 evictions instead of every ~4.6M, so batches cross the boundary
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AdaptivePolicy, "RENORMALISE", 1.002)
        _replay(name, ops)


@pytest.mark.parametrize("uses", [1, 3])
def test_a_batch_crossing_refresh_and_renormalise_matches_and_moves_the_table(monkeypatch, uses):
    monkeypatch.setattr(AdaptivePolicy, "RENORMALISE", 1.002)
    batched, one_by_one = GatedPolicy(), GatedPolicy()
    block = _block(10, uses, 0, 0, 70)
    for policy in (batched, one_by_one):
        policy.priority(_block(500, 1, 0, 0, 0))  # `now` ahead: victims have an age
        policy.returned(uses, 70)
    priority = batched.priority(block)
    assert one_by_one.priority(block) == priority
    batched.evicted_many(priority, 150)  # > REFRESH (64), and ~4 renormalisations
    for _ in range(150):
        one_by_one.evicted(priority)
    assert batched._scale < 1.002 and batched.inner._scale < 1.002  # it did renormalise
    assert batched._num_evictions == 150 and batched._stale and batched.inner._stale
    assert _state(batched) == _state(one_by_one)
    assert batched.inner.bonus == one_by_one.inner.bonus and batched.gate == one_by_one.gate
    if uses < 2:
        assert batched.inner.horizon > 0


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_evicted_many_of_none_changes_nothing(name):
    policy = make_policy(name)
    priority = policy.priority(_block(100, 1, 2, 0, 4))
    before = _state(policy)
    policy.evicted_many(priority, 0)
    assert _state(policy) == before


# ---------------------------------------------------------------- recall_many


def _tables(seed: int) -> tuple[tuple[GhostTable, list], tuple[GhostTable, list], list[bytes]]:
    """Two equal ghost tables (some hashes ghosts of each cause, some forgotten as ghosts
    but still in the key memory, some never seen), each with its record of returns."""
    rng = random.Random(seed)
    hashes = [rng.randbytes(16) for _ in range(60)]
    pairs = []
    for _ in range(2):
        returns: list[tuple[int, int]] = []
        table = GhostTable(20, lambda: 7.0, lambda uses, run, log=returns: log.append((uses, run)))
        for start in range(0, 45, 5):
            cause = ("adaptive", "lru", FLUSH, NOT_STORED)[start // 5 % 4]
            table.remember([(h, 1 + (i % 4), i) for i, h in enumerate(hashes[start : start + 5])], cause)
        pairs.append((table, returns))
    return pairs[0], pairs[1], hashes


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10), picks=st.lists(st.integers(0, 59), max_size=40))
def test_recall_many_answers_and_forgets_as_recall_each(seed, picks):
    (batched, batched_returns), (one_by_one, returns), hashes = _tables(seed)
    asked = [hashes[i] for i in picks]  # repeats included: the second finds no ghost
    assert batched.recall_many(asked) == [one_by_one.recall(h) for h in asked]
    assert batched_returns == returns
    assert list(batched._ghosts.items()) == list(one_by_one._ghosts.items())
    assert len(batched) == len(one_by_one)


def test_recall_many_covers_every_answer():
    (batched, batched_returns), (one_by_one, returns), hashes = _tables(0)
    answers = batched.recall_many(hashes + hashes[40:])
    assert answers == [one_by_one.recall(h) for h in hashes + hashes[40:]]
    assert {0, 1, 2, 3, 4} <= set(answers)  # never seen, key memory only, ghosts' uses
    assert batched_returns == returns and len(returns) == 10  # the policies' ghosts among the last 20
    assert len(batched) == 0
    # only the key memory answers now
    assert batched.recall_many(hashes[:3]) == [one_by_one.recall(h) for h in hashes[:3]] == [1, 1, 1]
    assert batched.recall_many([]) == []


# ---------------------------------------------------------------- remember_blocks


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10), sizes=st.lists(st.integers(0, 9), min_size=1, max_size=12))
def test_remember_blocks_remembers_what_remember_of_their_uses_does(seed, sizes):
    """An eviction's records (`remember_blocks`) and the (hash, commits + hits, run) tuples
    of the same blocks (`remember`) leave equal tables: ghosts, FIFO and key memory."""
    rng = random.Random(seed)
    from_blocks, from_tuples = GhostTable(16, lambda: 3.0), GhostTable(16, lambda: 3.0)
    pool = [rng.randbytes(16) for _ in range(30)]  # re-remembered hashes included
    for size in sizes:
        blocks = [_block(0, rng.randrange(1, 4), rng.randrange(3), 0, rng.randrange(9)) for _ in range(size)]
        for block in blocks:
            block.block_hash = rng.choice(pool)
        from_blocks.remember_blocks(blocks, "adaptive")
        from_tuples.remember(
            [(b.block_hash, b.num_seen + b.num_hits, b.run_length) for b in blocks], "adaptive"
        )
        assert from_blocks._ghosts == from_tuples._ghosts
        assert list(from_blocks._order) == list(from_tuples._order)
        assert (from_blocks.keys._young, from_blocks.keys._old) == (
            from_tuples.keys._young,
            from_tuples.keys._old,
        )
