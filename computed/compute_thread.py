"""The one thread that runs computed's torch work: model load, pool allocation, every forward.

Why one thread for all of it, start-up included: torch's CPU kernels run on GNU OpenMP,
which gives every thread that opens a parallel region its own team of workers, and
keeps them. Once more OpenMP threads exist than CPUs, libgomp stops spinning between
regions (100 spins instead of 300,000) and parks its workers on a futex, so each of
the ~50 parallel regions of a decode step pays a wake-up. A model loaded on the event
loop's thread and run on a forward thread made the default model's 8-row decode step
3.3 -> 4.7 ms on two cores (the same step, the same thread, before and after one
matrix product on the main thread). So the event loop's thread never runs a torch
kernel: what needs one is sent here.

Invariant: every call runs on the same OS thread, in submission order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class ComputeThread:
    """A single worker thread; `call` blocks the caller (start-up, before the event loop
    serves), `run` awaits it from the event loop."""

    def __init__(self, name: str = "forward") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def call(self, fn: Callable[..., T], *args: object) -> T:
        return self._executor.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
