"""The shared tier on the worker: device blocks to store values and back.

blockd decides what goes to the store and what comes from it; the worker copies when
a Step answer says so:

- *stores*: committed device blocks to write. Their K/V is read (`snapshot`, in the
  compute thread) before the next forward: a committed block is written by nobody,
  and blockd hands it out again only in an answer the worker applies after this one.
  The values go to the store in the background (`start_write`); the outcome of each is
  reported in a later Step (`take_reports`), and only then can anyone find the block
  in the shared tier.
- *fetches*: shared tier hits of an admitted sequence, fetched (`fetch`, one round
  trip) into its own fresh device blocks before the forward that reads them; a block
  whose value is missing or wrong is a miss (the sequence computes it itself) and is
  reported so blockd drops its record.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable, Sequence

import torch

from computed.kv_pool import KVPool
from computed.shared_store import Layout, SharedStore, StoredBlock, block_key, decode, header

# Write batches under way at once; past it, new writes are dropped (a slow store must
# not hold an unbounded amount of K/V in this process).
MAX_WRITES_IN_FLIGHT = 8


class SharedKV:
    def __init__(self, pool: KVPool, store: SharedStore) -> None:
        self.pool = pool
        self.store = store
        self.layout = Layout(
            pool.num_layers,
            pool.num_kv_heads,
            pool.head_dim,
            pool.block_size,
            str(pool.dtype).removeprefix("torch."),
            pool.dtype.itemsize,
        )
        # The namespace id blockd answered at registration (None until then).
        self.namespace: bytes | None = None
        self._written: list[bytes] = []
        self._failed: list[bytes] = []
        self._missing: list[bytes] = []
        self._writes: set[asyncio.Task] = set()
        self.on_reports: Callable[[], None] | None = None  # wakes the engine: reports to send

    # ------------------------------------------------------------ stores

    @torch.inference_mode()
    def snapshot(self, blocks: Sequence[StoredBlock]) -> list[tuple[str, memoryview]]:
        """(key, value) of each block, read from the device pool now (compute thread):
        each block's K/V is copied once, straight into its value's buffer."""
        namespace = self.namespace
        if not blocks or namespace is None:
            return []
        pool, layout = self.pool, self.layout
        shape = (pool.num_layers, 2, pool.block_size, pool.num_kv_heads, pool.head_dim)
        items = []
        for block in blocks:
            head = header(namespace, block, layout)
            value = bytearray(len(head) + layout.kv_nbytes)
            value[: len(head)] = head
            kv = torch.frombuffer(value, dtype=torch.uint8, offset=len(head)).view(pool.dtype).view(shape)
            kv.copy_(pool.kv[:, :, block.block_id])  # (L, 2, bs, H, D)
            items.append((block_key(namespace, block.block_hash), memoryview(value)))
        return items

    def start_write(self, items: list[tuple[str, memoryview]], blocks: Sequence[StoredBlock]) -> None:
        """Write in the background; the outcome waits in the reports."""
        if not items or len(self._writes) >= MAX_WRITES_IN_FLIGHT:
            # No namespace yet, or a store slower than the commits: drop, count, report.
            self.store.counters.num_write_failures += len(items)
            self._failed.extend(b.block_hash for b in blocks)
            return
        task = asyncio.get_running_loop().create_task(self._write(items, [b.block_hash for b in blocks]))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, items: list[tuple[str, memoryview]], hashes: list[bytes]) -> None:
        done = await self.store.write(items)
        for block_hash, ok in zip(hashes, done):
            (self._written if ok else self._failed).append(block_hash)
        if self.on_reports is not None:
            self.on_reports()

    # ------------------------------------------------------------ fetches

    async def fetch(self, blocks: Sequence[StoredBlock]) -> list[memoryview | None]:
        """Each block's K/V bytes, or None where the store had no valid value (those
        found missing or wrong are reported; a store error is a miss, not reported)."""
        namespace = self.namespace
        if not blocks or namespace is None:
            return [None] * len(blocks)
        errors_before = self.store.counters.num_fetch_errors
        values = await self.store.fetch([block_key(namespace, b.block_hash) for b in blocks])
        store_failed = self.store.counters.num_fetch_errors != errors_before
        found: list[memoryview | None] = []
        for block, value in zip(blocks, values):
            kv = decode(value, namespace, block, self.layout)
            if kv is None and not store_failed:
                self._missing.append(block.block_hash)
                self.store.counters.num_fetch_misses += 1
            found.append(kv)
        self.store.counters.num_fetched += sum(1 for kv in found if kv is not None)
        return found

    @torch.inference_mode()
    def apply_fetched(self, block_ids: Sequence[int], kvs: Sequence[memoryview]) -> None:
        """Copy fetched K/V into the device blocks (compute thread), each once."""
        pool = self.pool
        shape = (pool.num_layers, 2, pool.block_size, pool.num_kv_heads, pool.head_dim)
        with warnings.catch_warnings():  # read-only buffers: torch only reads them here
            warnings.simplefilter("ignore", UserWarning)
            for block_id, kv in zip(block_ids, kvs):
                source = torch.frombuffer(kv, dtype=torch.uint8).view(pool.dtype).view(shape)
                pool.kv[:, :, block_id].copy_(source)  # (L, 2, bs, H, D)

    # ------------------------------------------------------------ reports

    @property
    def has_reports(self) -> bool:
        return bool(self._written or self._failed or self._missing)

    def take_reports(self) -> tuple[list[bytes], list[bytes], list[bytes]]:
        """(written, failed, missing) hashes since the last call, for the next Step."""
        reports = (self._written, self._failed, self._missing)
        self._written, self._failed, self._missing = [], [], []
        return reports

    def forget_reports(self) -> None:
        """blockd lost this pool (re-registered): its pending writes are forgotten there."""
        self._written, self._failed, self._missing = [], [], []

    async def close(self) -> None:
        for task in list(self._writes):
            task.cancel()
        await asyncio.gather(*self._writes, return_exceptions=True)
        await self.store.close()

    async def measure_load_seconds_per_block(self, num_blocks: int = 16, repeats: int = 3) -> float:
        """Seconds to fetch one block (a pipelined read of `num_blocks` probe values of a
        block's size, best of a few); 0.0 when the store cannot be reached now."""
        value = bytes(self.layout.kv_nbytes + 256)
        keys = [f"kvcache-probe:{i}" for i in range(num_blocks)]
        if not all(await self.store.write(list(zip(keys, [value] * num_blocks)))):
            return 0.0
        best = float("inf")
        loop = asyncio.get_running_loop()
        for _ in range(repeats):
            started = loop.time()
            values = await self.store.fetch(keys)
            if any(v is None for v in values):
                return 0.0
            best = min(best, loop.time() - started)
        self.store.counters.num_written -= num_blocks
        self.store.counters.bytes_written = self.store.counters.bytes_fetched = 0
        return best / num_blocks
