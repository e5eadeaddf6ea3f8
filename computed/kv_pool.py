"""The physical KV cache: one tensor of fixed-size blocks, allocated once."""

from __future__ import annotations

import torch


class KVPool:
    """All K/V of every layer in one tensor of shape
    `(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)`.

    Invariants: the tensor is allocated once and never reallocated or resized; a block id
    indexes the same block in every layer; slot `block_id * block_size + offset` is one
    token's K (or V) row in a layer. The pool knows nothing about ownership or sharing:
    blockd decides which block ids a sequence may read and write. It is zero-initialised
    so that reading a never-written slot yields finite numbers (masked reads stay NaN-free).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=self.device
        )

    def key(self, layer: int) -> torch.Tensor:
        """View (num_blocks, block_size, num_kv_heads, head_dim) of one layer's keys."""
        return self.kv[layer, 0]

    def value(self, layer: int) -> torch.Tensor:
        """View (num_blocks, block_size, num_kv_heads, head_dim) of one layer's values."""
        return self.kv[layer, 1]

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block id costs across all layers, K and V."""
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize

    @staticmethod
    def num_blocks_for_budget(
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many whole blocks fit in `budget_bytes` (0 when not even one does)."""
        per_block = KVPool.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        return max(0, budget_bytes // per_block)

    @staticmethod
    def num_blocks_for_gpu_fraction(
        fraction: float,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> int:
        """Blocks that fit so the device's total use stays within `fraction` of its memory.

        Call it after the weights are loaded: the budget is `fraction * total - used_now`,
        read from `torch.cuda.mem_get_info`.
        """
        device = torch.device(device)
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if device.type != "cuda":
            raise ValueError(f"a GPU memory fraction needs a CUDA device, got {device}; give a byte budget")
        free, total = torch.cuda.mem_get_info(device)
        budget = int(fraction * total) - (total - free)
        return KVPool.num_blocks_for_budget(
            max(0, budget), num_layers, block_size, num_kv_heads, head_dim, dtype
        )
