"""The host tier's physical store and the copies between it and the device pool.

blockd decides what lives here (`blockd.host_tier`); the worker only copies when a
Step answer says so: *demotions* (device block -> host block, for device blocks that
blockd evicted and will hand out again) and *loads* (host block -> device block, for
host tier hits of an admitted sequence). Ordering, for every answer: all its
demotions, then all its loads, all before the next forward, which may overwrite a
demoted block or read a loaded one. A loaded block is committed (made findable) by
the normal commit after that forward, so nobody can hit it before its bytes are in.
"""

from __future__ import annotations

import time

import torch

from computed.directory_ops import CopyPlan
from computed.kv_pool import KVPool


class HostKV:
    """Host blocks in the device pool's layout: a tensor of shape
    `(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)`, allocated once
    (pinned when the pool is on CUDA, so copies run asynchronously)."""

    def __init__(self, pool: KVPool, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.pool = pool
        self.num_blocks = num_blocks
        on_cuda = pool.device.type == "cuda"
        shape = (pool.num_layers, 2, num_blocks, pool.block_size, pool.num_kv_heads, pool.head_dim)
        self.kv = torch.zeros(shape, dtype=pool.dtype, device="cpu", pin_memory=on_cuda)
        # Copies run on their own stream; the forward's stream waits for them.
        self._stream = torch.cuda.Stream(pool.device) if on_cuda else None
        self.num_blocks_copied = 0

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @torch.inference_mode()
    def apply(self, plan: CopyPlan) -> None:
        """Run a Step answer's copies: demotions first, then loads (see module doc)."""
        if self._stream is None:
            self._copy(plan)
            return
        current = torch.cuda.current_stream(self.pool.device)
        self._stream.wait_stream(current)  # the demoted blocks' last writes are done
        with torch.cuda.stream(self._stream):
            self._copy(plan)
        current.wait_stream(self._stream)  # the next forward sees the loads

    def _copy(self, plan: CopyPlan) -> None:
        device = self.pool.device
        pool_kv = self.pool.kv
        if plan.demotions:
            blocks = torch.tensor([b for b, _ in plan.demotions], dtype=torch.long, device=device)
            hosts = torch.tensor([h for _, h in plan.demotions], dtype=torch.long)
            # (L, 2, n, bs, H, D) gathered on the device, then one transfer
            self.kv[:, :, hosts] = pool_kv[:, :, blocks].to("cpu", non_blocking=True)
        if plan.loads:
            blocks = torch.tensor([b for b, _ in plan.loads], dtype=torch.long, device=device)
            hosts = torch.tensor([h for _, h in plan.loads], dtype=torch.long)
            pool_kv[:, :, blocks] = self.kv[:, :, hosts].to(device, non_blocking=True)
        self.num_blocks_copied += len(plan.demotions) + len(plan.loads)

    def measure_load_seconds_per_block(self, num_blocks: int = 16, repeats: int = 5) -> float:
        """Seconds to load one block (host -> device), measured on blocks no sequence
        holds yet (call before registering with blockd): the best of a few runs."""
        n = max(1, min(num_blocks, self.num_blocks, self.pool.num_blocks))
        plan = CopyPlan(loads=[(i, i) for i in range(n)])
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            self.apply(plan)
            if self._stream is not None:
                torch.cuda.synchronize(self.pool.device)
            best = min(best, time.perf_counter() - started)
        self.num_blocks_copied = 0
        return best / n
