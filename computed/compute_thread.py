"""The one thread that runs computed's torch work: model load, pool allocation, every forward.

Why one thread for all of it, start-up included: torch's CPU kernels run on GNU OpenMP,
which gives every thread that opens a parallel region its own team of workers, and
keeps them. Once more OpenMP threads exist than CPUs, libgomp stops spinning between
regions (100 spins instead of 300,000) and parks its workers on a futex, so each of
the ~50 parallel regions of a decode step pays a wake-up. A model loaded on the event
loop's thread and run on a forward thread made the default model's 8-row decode step
3.3 -> 4.7 ms on two cores (the same step, the same thread, before and after one
matrix product on the main thread). So all torch work runs on one thread.

Which thread (`ComputeThread(own_thread=...)`):
- its own worker thread (the default; computed's `--forward-on thread`): the loop keeps
  serving during a step.
- the caller's (`--forward-on loop`): the event loop's own thread runs every forward, and
  the loop waits for it. A step's end then wakes nobody: with a worker thread, its end
  wakes the event loop's thread from its poll (the loop's self-pipe write, ~0.2 ms a step
  on a 2-vCPU VM: 5% of the forward thread's samples in py-spy). Chat of the peer bench
  (8 x 6 turns, `make bench-peer`), interleaved runs: 1.63 / 1.69 s -> 1.57 / 1.49 s. The
  cost, and why it is not the default: the loop serves nothing while a step runs, so
  requests that arrive during one are admitted only between steps, and a burst trickles
  in: the peer bench's 64 requests sent at once joined over 10+ steps of 3-9 each, where
  the worker thread admits all 63 waiting ones in the step after the first (shared
  workload 1.12 -> 1.18 s).

Invariant: every call runs on the same OS thread, in submission order.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class ComputeThread:
    """`call` blocks the caller (start-up, before the event loop serves), `run` awaits the
    work from the event loop; both on the one compute thread."""

    def __init__(self, own_thread: bool = True, name: str = "forward") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) if own_thread else None
        self._caller: int | None = None  # inline: the thread every call came from

    @property
    def own_thread(self) -> bool:
        return self._executor is not None

    def call(self, fn: Callable[..., T], *args: object) -> T:
        if self._executor is None:
            return self._inline(fn, *args)
        return self._executor.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        if self._executor is None:
            return self._inline(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def _inline(self, fn: Callable[..., T], *args: object) -> T:
        caller = threading.get_ident()
        if self._caller is None:
            self._caller = caller
        assert self._caller == caller, "an inline ComputeThread was called from a second thread"
        return fn(*args)
