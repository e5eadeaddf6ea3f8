"""blockd's garbage collection pacing: survivors frozen after each collection, the frozen
heap collected every `full_every` collections on the loop (blockd/gc_pacing.py)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from blockd.gc_pacing import GcPacer


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> _Node:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a


@pytest.fixture
def loop():
    """A loop, and the interpreter's collector as it was, restored after the test."""
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    if enabled:
        gc.enable()


def test_survivors_of_a_collection_are_frozen_and_a_full_collection_finds_what_died_frozen(loop):
    pacer = GcPacer(loop, threshold=50_000, full_every=1_000)
    pacer.start()
    try:
        assert gc.get_threshold()[0] == 50_000
        kept = _cycle()
        frozen_before = gc.get_freeze_count()
        gc.collect()
        assert gc.get_freeze_count() > frozen_before  # the live cycle among them
        assert pacer.num_collections == 1
        del kept  # dies while frozen: an ordinary collection never looks at it
        assert gc.collect() == 0
        assert pacer.collect_all() >= 2  # the thawed heap's collection finds both nodes
        assert pacer.num_full == 1 and gc.get_freeze_count() > 0
    finally:
        pacer.stop()


def test_every_full_every_collections_a_full_collection_runs_on_the_loop(loop):
    pacer = GcPacer(loop, threshold=50_000, full_every=2)
    pacer.start()
    try:
        gc.collect()
        gc.collect()  # the second: a full collection is scheduled, not run in the callback
        assert pacer.num_full == 0
        loop.run_until_complete(asyncio.sleep(0))
        assert pacer.num_full == 1
    finally:
        pacer.stop()
    seen = pacer.num_collections  # the two, and the full collection's own
    gc.collect()
    assert seen == 3 and pacer.num_collections == 3  # stopped: this one is not seen


def test_stop_removes_the_callback(loop):
    pacer = GcPacer(loop)
    pacer.start()
    pacer.stop()
    assert pacer._on_collection not in gc.callbacks
    gc.collect()
    assert pacer.num_collections == 0
