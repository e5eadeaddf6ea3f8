"""Attention backends: the device-specific half of paged attention, chosen once.

`computed.attention` plans a step (tiles of queries x pool slots, `AttentionBatch`) and
runs it per layer through one `AttentionBackend`: write the new K/V into the pool, attend
each tile, merge the partials of rows read through several tiles. Which backend runs is
decided once, from the device, the model's and the pool's dtypes, the head shape and the
kernels that built (`registry.select_attention_backend`); `ModelRunner` picks it when the
model loads and logs `attention_backend_selected backend=... reason=...`. A new device
backend is one module here plus one entry in `registry.py`.

Which code runs when (the three forwards of a model, and the attention inside them):

- `cpu_native`: CPU, float32 model, float32 or bfloat16 pool, `computed.kernels` built.
  Decode tiles run `paged_decode`, tiles of several queries `paged_flash`; the write and
  the merge are the native ops. The model's forward there is `NativeForward`
  (computed/model/native.py): a decode step (every row read) takes the C++
  `forward_layers`, which runs these same kernels for every layer in one op (it reads the
  tiles from `AttentionBatch.native_tiles`); other steps run its Python layer loop, whose
  attention is this backend.
- `cuda_triton`: CUDA with Triton and a head shape its kernel takes; every tile runs
  `computed.triton_attention`'s flash kernel; the forward is `CausalLM.forward` (modules).
- `torch_portable`: everything else (CPU without the kernels or in another dtype, CUDA
  without Triton, other devices): torch's fused CPU flash kernel where the model and the
  pool are float32 on CPU, else float32 matmuls; `CausalLM.forward`.

The three forwards compute the same ops in the same order (bit for bit on CPU float32:
tests/computed/test_native_forward.py); merging them into one is issue 42's open part.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    """The per-layer half of paged attention. Every method takes whole-step tensors and
    issues a fixed number of kernel calls, whatever the number of sequences.

    Invariants: `attend_tile` returns float32 partials (out, log-sum-exp) of the tile's
    padded rows, item-major; `merge` combines the partials of each row exactly as the
    log-sum-exp says (`merge_index` of the plan). Results are deterministic: the same
    inputs give the same bits, so a captured graph and an eager step agree.
    """

    name: str

    def write(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """keys/values (N * B, Hkv, D) one layer's pool, one row per slot; k_new/v_new (W, Hkv, D)."""
        ...

    def attend_tile(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tile, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (T, H, D) the step's queries; keys/values (N * B, Hkv, D); tile a
        `computed.attention.Tile`. -> float32 out (I * Qm, H, D), log-sum-exp (I * Qm, H)."""
        ...

    def merge(self, outs: list[torch.Tensor], lses: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
        """Each row's partials (named by `index` (T, depth)) merged -> float32 (T, H, D)."""
        ...
