"""Attention in torch ops only: any device, any dtype (the fallback of every other backend).

Each tile gathers its keys and values from the pool (`index_select` over the slot list),
then runs torch's fused CPU flash kernel where the model and the pool are float32 on CPU
(it beat a batched matmul by 1.6-2.4x and one SDPA call per sequence by 2x, see
`computed.attention`), else float32 matmuls. The new K/V are written with `index_copy_`
and partials merged with dense gathers, except where `computed.kernels` gives the CPU its
native write and merge (chosen once by the registry, as for every op here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TorchPortable:
    # torch's `_scaled_dot_product_flash_attention_for_cpu` where it applies (CPU, float32
    # queries and pool), else None: the matmul path.
    cpu_flash: Callable | None = None
    native_write: Callable | None = None  # kvcache::write_kv (CPU, float32 new K/V), else None
    native_merge: Callable | None = None  # kvcache::merge_partials (CPU), else None
    name: str = "torch_portable"

    def write(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        if self.native_write is not None:  # one call, v read where it lies (see kv_write.cpp)
            self.native_write(keys, values, k_new, v_new, slots)
            return
        keys.index_copy_(0, slots, k_new.to(keys.dtype))
        values.index_copy_(0, slots, v_new.to(values.dtype))

    def attend_tile(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tile, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_kv_heads, head_dim = keys.shape[1], keys.shape[2]
        items, width_k = tile.num_items, tile.num_keys
        qt = q[tile.query_rows]  # (I, Qm, H, D)
        kt = keys.index_select(0, tile.key_slots).view(
            items, width_k, num_kv_heads, head_dim
        )  # (I, Lm, Hkv, D)
        vt = values.index_select(0, tile.key_slots).view(items, width_k, num_kv_heads, head_dim)
        if self.cpu_flash is not None:
            return _attend_tile_cpu_flash(self.cpu_flash, qt, kt, vt, tile, scale)
        return attend_tile_matmul(qt, kt, vt, tile, scale)

    def merge(self, outs: list[torch.Tensor], lses: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
        if self.native_merge is not None:
            return self.native_merge(outs, lses, index)
        return merge_dense(outs, lses, index)


def _attend_tile_cpu_flash(
    flash: Callable, qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, tile, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    items, width_q, num_heads, head_dim = qt.shape
    num_kv_heads = kt.shape[2]
    group = num_heads // num_kv_heads
    if tile.causal:
        # Causal rows need their own positions: repeat K/V per query head instead.
        kh = kt.transpose(1, 2).repeat_interleave(group, dim=1)  # (I, H, Lm, D)
        vh = vt.transpose(1, 2).repeat_interleave(group, dim=1)
        o, lse = flash(qt.transpose(1, 2), kh, vh, 0.0, True, scale=scale)  # (I, H, Qm, D), (I, H, Qm)
        return (
            o.transpose(1, 2).reshape(items * width_q, num_heads, head_dim),
            lse.transpose(1, 2).reshape(items * width_q, num_heads),
        )
    # Fold each K/V head's query heads into its query rows: (I, Hkv, Qm * g, D).
    qf = qt.view(items, width_q, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    qf = qf.reshape(items, num_kv_heads, width_q * group, head_dim)
    o, lse = flash(
        qf, kt.transpose(1, 2), vt.transpose(1, 2), 0.0, False, attn_mask=tile.key_bias, scale=scale
    )  # (I, Hkv, Qm*g, D), (I, Hkv, Qm*g)
    o = o.view(items, num_kv_heads, width_q, group, head_dim).permute(0, 2, 1, 3, 4)
    lse = lse.view(items, num_kv_heads, width_q, group).permute(0, 2, 1, 3)
    return o.reshape(items * width_q, num_heads, head_dim), lse.reshape(items * width_q, num_heads)


def attend_tile_matmul(
    qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, tile, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A tile's attention in float32 matmuls (any device, any dtype): qt (I, Qm, H, D),
    kt/vt (I, Lm, Hkv, D) -> out (I * Qm, H, D), log-sum-exp (I * Qm, H)."""
    items, width_q, num_heads, head_dim = qt.shape
    width_k, num_kv_heads = kt.shape[1], kt.shape[2]
    group = num_heads // num_kv_heads
    qg = (
        qt.float().view(items, width_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    )  # (I, Hkv, g, Qm, D)
    scores = qg @ kt.float().permute(0, 2, 3, 1)[:, :, None] * scale  # (I, Hkv, g, Qm, Lm)
    if tile.causal:
        future = torch.ones(width_q, width_k, dtype=torch.bool, device=qt.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if tile.key_bias is not None:
        scores = scores + tile.key_bias[:, :, None]  # (I, 1, 1, 1, Lm)
    lse = scores.logsumexp(dim=-1)  # (I, Hkv, g, Qm)
    o = (scores - lse[..., None]).exp() @ vt.float().transpose(1, 2)[:, :, None]  # (I, Hkv, g, Qm, D)
    o = o.permute(0, 3, 1, 2, 4).reshape(items * width_q, num_heads, head_dim)
    return o, lse.permute(0, 3, 1, 2).reshape(items * width_q, num_heads)


def merge_dense(outs: list[torch.Tensor], lses: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """out[r] = sum_p exp(lse_p - m_r) o_p / sum_p exp(lse_p - m_r), m_r = max_p lse_p, over
    the partials p of row r (what `kvcache::merge_partials` computes on CPU). Dense gathers,
    no scatter: `index` (T, depth) names each row's partials among the tiles' results
    concatenated, the sentinel R (zeros, lse -inf) weighing nothing."""
    o = torch.cat([*outs, outs[0].new_zeros(1, *outs[0].shape[1:])])  # (P + 1, H, D)
    lse = torch.cat([*lses, lses[0].new_full((1, lses[0].shape[1]), float("-inf"))])  # (P + 1, H)
    num_tokens, depth = index.shape
    flat = index.reshape(-1)
    lse_r = lse.index_select(0, flat).view(num_tokens, depth, -1)  # (T, depth, H)
    weight = (lse_r - lse_r.amax(dim=1, keepdim=True)).exp_()  # (T, depth, H); every row has one real
    o_r = o.index_select(0, flat).view(num_tokens, depth, *o.shape[1:])  # (T, depth, H, D)
    return (o_r * weight[..., None]).sum(dim=1) / weight.sum(dim=1)[..., None]
