"""The native kernels' parallel loop (computed/kernels/parallel.h): every index of a range
runs exactly once, whatever the threads do, helpers take part in a long range, callers
on several threads take turns, and a child process made by fork runs it on its own."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from computed import kernels

visits = kernels.parallel_visits()
pytestmark = pytest.mark.skipif(visits is None, reason=f"native kernels unavailable: {kernels.error()}")


@pytest.fixture
def threads():
    """Sets torch's intra-op thread count for the test, restoring it after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [1, 2, 4])
@pytest.mark.parametrize(
    "n,grain", [(0, 1), (1, 1), (5, 8), (8, 8), (9, 8), (1000, 1), (1000, 64), (50_000, 7)]
)
def test_every_index_runs_exactly_once(threads, num_threads: int, n: int, grain: int) -> None:
    threads(num_threads)
    counts, used = visits(n, grain)
    assert counts.shape == (n,) and bool((counts == 1).all()), counts.unique()
    assert used <= max(1, num_threads)
    if n <= grain:
        assert used <= 1  # one grain or less runs inline, on the caller


def test_helpers_take_part_in_a_long_range(threads) -> None:
    threads(2)
    used = max(visits(200_000, 1)[1] for _ in range(5))  # a busy machine may delay a helper once
    assert used == 2


def test_callers_on_several_threads_take_turns(threads) -> None:
    threads(2)
    results: list[bool] = []

    def call() -> None:
        for _ in range(20):
            counts, _ = visits(20_000, 3)
            results.append(bool((counts == 1).all()))

    workers = [threading.Thread(target=call) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert len(results) == 60 and all(results)


def _in_child(queue) -> None:
    # under torch's grain for a parallel fill: torch's own OpenMP team is not fork-safe
    counts, used = kernels.parallel_visits()(30_000, 1)
    queue.put((bool((counts == 1).all()), used))


def test_a_forked_child_runs_the_loop_on_its_own(threads) -> None:
    threads(2)
    visits(200_000, 1)  # the parent's helpers exist before the fork
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_in_child, args=(queue,))
    child.start()
    child.join(120)
    assert child.exitcode == 0, "the child hung or died running the loop"
    assert queue.get(timeout=5) == (True, 1)  # inline: the helpers stayed with the parent
