"""Rotary position embedding, rotate-half convention (as Hugging Face Llama/Qwen)."""

from __future__ import annotations

import math

import torch

from computed import kernels
from computed.model.config import Llama3RopeScaling


class RotaryEmbedding:
    """cos/sin tables indexed by absolute position.

    The float32 table grows lazily (powers of two, capped at max_positions) per device, so
    a model with a 128k context does not pay for 128k rows until a prompt needs them.
    Values are computed exactly as transformers does (float32 outer product, then cast to
    the activations' dtype), so cached and uncached K agree bit for bit.
    """

    def __init__(
        self, head_dim: int, theta: float, max_positions: int, scaling: Llama3RopeScaling | None = None
    ) -> None:
        self.max_positions = max_positions
        # Explicit CPU: the model may be built under a `torch.device("meta")` context.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
        self.inv_freq = _llama3_scale(inv_freq, scaling) if scaling is not None else inv_freq  # (D/2,)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(
        self, positions: torch.Tensor, max_position: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (T, D) for `positions` (T,), whose largest value is `max_position`.

        `max_position` is passed in (the batch builder knows it) to avoid a device sync.
        """
        if not 0 <= max_position < self.max_positions:
            raise ValueError(f"position {max_position} outside the model's {self.max_positions} positions")
        cos, sin = self._table(positions.device, max_position + 1)
        # index_select, not cos[positions]: ~3 against ~13 us a call (advanced indexing)
        return cos.index_select(0, positions).to(dtype), sin.index_select(0, positions).to(dtype)

    def _table(self, device: torch.device, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(device)
        if table is None or table[0].shape[0] < needed:
            length = min(self.max_positions, max(256, 1 << (needed - 1).bit_length()))
            inv_freq = self.inv_freq.to(device)
            freqs = torch.arange(length, dtype=torch.float, device=device)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # (L, D)
            table = (emb.cos(), emb.sin())
            self._tables[device] = table
        return table


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary` to q (T, H, D) and k (T, Hkv, D). On CPU float32 one call of the
    native `kvcache::rotary`, bit for bit the same: torch's ops are ten tiny kernels per
    layer, dispatch-bound in a decode step (`python -m bench.attention_kernels`, rotary
    block)."""
    if q.device.type == "cpu" and q.dtype == k.dtype == cos.dtype == sin.dtype == torch.float32:
        op = kernels.rotary()
        if (
            op is not None
            and cos.is_contiguous()
            and sin.is_contiguous()
            and q.stride(-1) == k.stride(-1) == 1
        ):
            return op(q, k, cos, sin)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by cos/sin (T, D)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _llama3_scale(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
