"""Attention by `computed.kernels`' native CPU ops (float32 queries, float32 or bfloat16 pool).

A tile of one query per item (every decode row's private context) runs the paged decode
kernel: it reads each key and value once, straight from the pool through the slot list.
Tiles of several queries per item (prefill chunks, shared segments) run the paged flash
kernel where it takes the head shape (head size a multiple of 8, at most 64 query heads
per K/V head), else torch's (`TorchPortable`). Measurements: `computed.attention`'s
docstring (`python -m bench.attention_kernels`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from computed.backends.torch_portable import TorchPortable


@dataclass(frozen=True)
class CpuNative:
    decode: Callable | None  # kvcache::paged_decode
    flash: Callable | None  # kvcache::paged_flash where it takes the head shape
    fallback: TorchPortable  # its write and merge are the native ones where they built
    name: str = "cpu_native"

    def write(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        self.fallback.write(keys, values, k_new, v_new, slots)

    def attend_tile(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tile, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        items, width_q = tile.num_items, tile.num_queries
        if width_q == 1 and not tile.causal and self.decode is not None:
            # One query per item: read K/V from the pool, no gather.
            return self.decode(
                q.contiguous() if tile.in_order else q.index_select(0, tile.query_rows.view(-1)),  # (I, H, D)
                keys,
                values,
                tile.key_slots.view(items, tile.num_keys),
                tile.key_lens,
                scale,
            )
        if self.flash is None:
            return self.fallback.attend_tile(q, keys, values, tile, scale)
        return run_flash(self.flash, q, keys, values, tile, scale)

    def merge(self, outs: list[torch.Tensor], lses: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
        return self.fallback.merge(outs, lses, index)


def run_flash(
    flash: Callable, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tile, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A tile through an op with the paged flash contract (the native one, the Triton one):
    (I, Qm, H, D) queries, the pool's keys/values, (I, Lm) slots, key lens, causal, scale
    -> (I, Qm, H, D), (I, Qm, H) float32, returned flat (I * Qm, ...)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    items, width_q = tile.num_items, tile.num_queries
    o, lse = flash(
        (
            q.reshape(items, width_q, num_heads, head_dim)
            if tile.in_order
            # index_select, not q[rows]: ~5 against ~14 us a call (advanced indexing)
            else q.index_select(0, tile.query_rows.view(-1)).view(items, width_q, num_heads, head_dim)
        ).contiguous(),  # (I, Qm, H, D)
        keys,
        values,
        tile.key_slots.view(items, tile.num_keys),
        tile.key_lens,
        tile.causal,
        scale,
    )  # (I, Qm, H, D), (I, Qm, H)
    return o.view(items * width_q, num_heads, head_dim), lse.view(items * width_q, num_heads)
