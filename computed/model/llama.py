"""Llama-family causal LM (Llama 2/3, Qwen2, Qwen3) over a paged KV pool.

Module and parameter names mirror Hugging Face's, so a checkpoint's tensor names are the
state-dict keys (`model.layers.0.self_attn.q_proj.weight`, ...). Differences between the
families are config flags: q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), tied
embeddings, Llama-3 RoPE scaling.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from computed import triton_layers
from computed.attention import AttentionBatch, attend, paged_attention, write_new_kv
from computed.backends import AttentionBackend
from computed.backends.registry import AttentionTarget, BackendChoice, select_attention_backend
from computed.kv_pool import KVPool
from computed.model.config import ModelConfig
from computed.model.layers import Linear, RMSNorm, SwiGLU, fuse_rows, linear, pack_weight
from computed.model.native import NativeForward
from computed.model.rope import RotaryEmbedding, apply_rotary_qk
from computed.output_rows import OutputRows


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.scale = config.head_dim**-0.5
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = Linear(config.hidden_size, q_size, bias=config.attention_bias)
        self.k_proj = Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.v_proj = Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)
        if config.has_qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.split_sizes = [q_size, kv_size, kv_size]
        # (q_size + 2 * kv_size, hidden): q's rows, k's, v's, once `fuse()` ran; packed by `pack()`.
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.register_buffer("qkv_packed", None, persistent=False)
        # The attention backend chosen at load (`CausalLM.use_attention_backend`); None asks
        # the registry per call.
        self.backend: AttentionBackend | None = None
        self.triton_ops = False  # q/k norms and rotary as one Triton kernel (computed.triton_layers)

    def fuse(self) -> None:
        """q, k and v as one product (see `fuse_rows`)."""
        self.qkv_weight, self.qkv_bias = fuse_rows(self.q_proj, self.k_proj, self.v_proj)

    def pack(self, products: torch.dtype = torch.float32) -> None:
        """Pack the weights of the products `forward` runs (see `pack_weight`)."""
        if self.qkv_weight is None:
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                proj.pack(products)
        else:
            self.qkv_packed = pack_weight(self.qkv_weight, products)
        self.o_proj.pack(products)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        read: OutputRows | None = None,
    ) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); with `read`, writes all T rows' K/V and answers
        the (S, hidden) of its rows only."""
        num_tokens = x.shape[0]
        if self.qkv_weight is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:  # column blocks of one (T, q_size + 2 * kv_size) product
            q, k, v = linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed).split(
                self.split_sizes, dim=-1
            )
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        if self.triton_ops and hasattr(self, "q_norm"):  # Qwen3: the norms, then rotary, one kernel
            q, k = triton_layers.qk_norm_rotary(
                q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin
            )
        elif self.triton_ops:
            q, k = triton_layers.qk_norm_rotary(q, k, None, None, 0.0, cos, sin)
        else:
            if hasattr(self, "q_norm"):
                # Contiguous, as the unfused products are: the norm then takes its native kernel.
                q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
            q, k = apply_rotary_qk(q, k, cos, sin)
        if read is None:
            out = paged_attention(q, k, v, self.layer_idx, batch, pool, self.scale, self.backend)  # (T, H, D)
        else:
            write_new_kv(k, v, self.layer_idx, batch, pool, self.backend)
            if read.batch is None:  # no row read: the K/V were all that was needed
                return x.new_empty(0, x.shape[1])
            out = attend(
                q.index_select(0, read.rows), self.layer_idx, read.batch, pool, self.scale, self.backend
            )  # (S, H, D)
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.triton_ops = False  # the residual add and the norm after it as one Triton kernel

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        read: OutputRows | None = None,
    ) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden), or (S, hidden) for `read`'s rows (see `Attention`)."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, batch, pool, read)
        x = x if read is None else x.index_select(0, read.rows)
        if self.triton_ops:  # (norm(x + attn), x + attn) in one pass
            norm = self.post_attention_layernorm
            h, x = triton_layers.add_rms_norm(attn, x, norm.weight, norm.eps)
            return x + self.mlp(h)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Hidden states for a flat batch of new tokens; logits only where asked.

    `forward` writes the new tokens' K/V into `pool` (as `batch` says) and returns the
    final-normed hidden states, of every row or of the rows `read` names (the last layer
    past its q/k/v product then runs for those alone); `compute_logits` projects the rows
    the caller picks, so a long prefill pays the vocabulary product for one row only.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position_embeddings, config.rope_scaling
        )
        self.tie_weights()
        # The same forward without the modules' glue, once `pack_projections` ran on CPU float32.
        self.native: NativeForward | None = None
        self.attention_backend: AttentionBackend | None = None  # see `use_attention_backend`

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output head when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self) -> None:
        """Each layer's q/k/v and gate/up products as one each (`fuse_rows`: the same
        results, parameters unchanged by name and value). Call once loaded on the device."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def pack_projections(self, products: torch.dtype = torch.float32) -> None:
        """Every product's weight packed for the native CPU kernel (`pack_weight`: a second
        copy of the weights, laid out for `kvcache::packed_linear`; a no-op off CPU float32),
        its inputs rounded to bfloat16 where `products` says so. Call after
        `fuse_projections`, once the weights are final: `forward` then runs `NativeForward`
        where every product packed (bit for bit the modules' results)."""
        for layer in self.model.layers:
            layer.self_attn.pack(products)
            layer.mlp.pack(products)
        self.lm_head.pack(products)
        self.native = NativeForward.build(self)

    def choose_attention_backend(self, pool: KVPool) -> BackendChoice:
        """Ask the registry once which attention backend serves this model over `pool`
        (device, dtypes, head shape, kernels built), and use it from now on."""
        c = self.config
        dtype = self.model.embed_tokens.weight.dtype  # the hidden states' and so the queries'
        target = AttentionTarget(pool.device, dtype, pool.dtype, c.head_dim, c.num_heads // c.num_kv_heads)
        choice = select_attention_backend(target)
        self.use_attention_backend(choice.backend)
        if choice.backend.name == "cuda_triton" and triton_layers.enabled(pool.device):
            self.use_triton_layers(True)
            choice = dataclasses.replace(
                choice, reason=f"{choice.reason}; layer ops fused ({triton_layers.ENV}=1)"
            )
        return choice

    def use_triton_layers(self, on: bool) -> None:
        """Every norm, residual add + norm, q/k norm + rotary and SiLU·mul of the modules'
        forward as one Triton kernel each (`computed.triton_layers`), or torch's ops again."""
        for module in self.modules():
            if hasattr(module, "triton_ops"):
                module.triton_ops = on

    def use_attention_backend(self, backend: AttentionBackend) -> None:
        """Every layer's attention through `backend` (`computed.backends.registry`'s choice
        for this model and its pool, made once at load), not a choice per call."""
        self.attention_backend = backend
        for layer in self.model.layers:
            layer.self_attn.backend = backend
        if self.native is not None:
            self.native = dataclasses.replace(self.native, backend=backend)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, batch: AttentionBatch, pool: KVPool, read: OutputRows | None = None
    ) -> torch.Tensor:
        """input_ids (T,) -> hidden (T, hidden_size); with `read`, (S, hidden_size) of its
        rows only, the last layer past its q/k/v product run for them alone
        (`computed.output_rows`). Every new token's K/V is written either way."""
        self._check_pool(pool)
        if self.native is not None:
            return self.native.forward(input_ids, batch, pool, read)
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary.cos_sin(batch.positions, batch.max_position, x.dtype)  # (T, D) each
        *layers, last = self.model.layers
        for layer in layers:
            x = layer(x, cos, sin, batch, pool)
        if read is not None and read.batch is None:  # no row read: the last layer's K/V only
            last.self_attn(last.input_layernorm(x), cos, sin, batch, pool, read)
            return x.new_empty(0, x.shape[1])
        return self.model.norm(last(x, cos, sin, batch, pool, read))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, hidden_size) -> float32 logits (N, vocab_size).

        The matmul runs in the model's dtype (as transformers does); the result is upcast.
        """
        if self.native is not None:
            return self.native.compute_logits(hidden)
        return self.lm_head(hidden).float()

    def _check_pool(self, pool: KVPool) -> None:
        c = self.config
        assert (pool.num_layers, pool.num_kv_heads, pool.head_dim) == (
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
        ), (
            f"pool shaped for {pool.num_layers} layers x {pool.num_kv_heads} heads x {pool.head_dim}, "
            f"model needs {c.num_layers} x {c.num_kv_heads} x {c.head_dim}"
        )
