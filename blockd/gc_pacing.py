"""Garbage collection paced for Step latency: each collection's survivors are frozen.

Why: the directory's records (blocks, sequences, pins) hold no reference cycles, yet a
busy pool creates and drops thousands of them a second, and CPython's collector
traverses every object of the generations it collects. Survivors of the young
generation age into the older ones, so some collections traversed every cached block
of every pool: pauses of 13 ms at the median and up to 140 ms, which set blockd's Step
p99 (bench.blockd_gc, and `gc.callbacks` timings in the last stop's note). Frozen
objects (`gc.freeze`) are never traversed again, so each collection here scans only
what was allocated since the one before (at most `threshold` objects).

What it costs: a reference cycle that was alive at a collection and dies later is only
found by a collection of the frozen heap. The directory makes none (an in-process
replay of bench.blockd_inprocess's Steps with the collector off left 0 unreachable
objects); gRPC's server makes about 5 per RPC call (its handler lookup: 640 objects
after a closed-loop run of bench.blockd_fleet, collector off). So every `full_every`
collections the frozen heap is thawed and collected once, on the event loop: as rare as
CPython's own full collections under blockd's former thresholds, and it bounds what
waits to be found to what that many collections froze.

Ordering: the callback runs at the end of each collection (in whatever thread
triggered it); the full collection is only scheduled from there and runs later on the
loop (the collector does not collect from within its own callbacks).
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

# Allocations between young collections (CPython's default: 700). Measured with
# survivors frozen (bench.blockd_gc's open loop, 2 turns of 8 s, in turns): 50,000 gave a
# Step p99 of 16 ms (max 92) against 51 ms (max 100) at 10,000: fewer, longer pauses.
THRESHOLD = 50_000
FULL_EVERY = 1_000  # collections between two collections of the frozen heap


class GcPacer:
    """Installs the pacing on `start` (thresholds, a freeze of the start-up heap, the
    callback) and removes its callback on `stop`; `num_collections` and `num_full`
    count what it saw and did."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, threshold: int = THRESHOLD, full_every: int = FULL_EVERY
    ) -> None:
        assert threshold >= 1 and full_every >= 1, "threshold and full_every must be >= 1"
        self._loop = loop
        self.threshold = threshold
        self.full_every = full_every
        self.num_collections = 0
        self.num_full = 0
        self._full_pending = False

    def start(self) -> None:
        gc.set_threshold(self.threshold, 20, 100)
        gc.freeze()  # the start-up heap: the server's own long-lived objects
        gc.callbacks.append(self._on_collection)

    def stop(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase != "stop":
            return
        gc.freeze()
        self.num_collections += 1
        if self.num_collections % self.full_every == 0 and not self._full_pending:
            self._full_pending = True
            self._loop.call_soon_threadsafe(self.collect_all)

    def collect_all(self) -> int:
        """Collect the whole heap, frozen objects included, then freeze the survivors
        again; answers the unreachable objects found."""
        self._full_pending = False
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        self.num_full += 1
        return found
