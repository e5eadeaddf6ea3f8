"""Attention on CUDA by `computed.triton_attention`'s paged flash kernel: every tile,
decode rows included (`python -m bench.gpu_attention`, H100, one layer of Qwen3-0.6B's
heads in bfloat16: 256 decode rows x 1,024 keys 9.9-10.2 -> 0.51-0.62 ms against the
matmul path). The write is one `index_copy_` per K and V, the merge torch's dense one:
both are fixed-shape, capture-safe ops (no host sync), as a CUDA graph needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from computed.backends.cpu_native import run_flash
from computed.backends.torch_portable import merge_dense


@dataclass(frozen=True)
class CudaTriton:
    flash: Callable  # triton_attention.paged_flash()
    name: str = "cuda_triton"

    def write(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        keys.index_copy_(0, slots, k_new.to(keys.dtype))
        values.index_copy_(0, slots, v_new.to(values.dtype))

    def attend_tile(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tile, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return run_flash(self.flash, q, keys, values, tile, scale)

    def merge(self, outs: list[torch.Tensor], lses: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
        return merge_dense(outs, lses, index)
