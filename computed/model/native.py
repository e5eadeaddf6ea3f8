"""The CPU float32 forward as one loop over plain tensors, for when every native kernel loaded.

`CausalLM.forward` runs its modules: ~10 module calls a layer, a dozen parameter and
buffer lookups (`nn.Module.__getattr__`, ~2 us each) and per-call dtype/device checks,
about 1 ms of a decode step that is 3-8 ms for a batch of 1-8 rows (glue, not
arithmetic). This runs the same ops in the same order on the same tensors, pulled out of
the modules once after packing, so its results are bit for bit the modules'
(tests/computed/test_native_forward.py). A whole step through `ModelRunner.run`
(`python -m bench.attention_kernels`, decode steps block): 1 row 3.9 -> 2.8 ms, 8 rows
over 1,113 keys 7.6 -> 6.6 ms, 64 rows over 1,121 keys 22.0 -> 21.0 ms.

Invariant: built from a model whose weights are final (`CausalLM.pack_projections`); the
tensors here are the modules' own (views, not copies), so a weight changed in place
afterwards would show here, and a weight replaced by another tensor would not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from computed import kernels
from computed.attention import NATIVE_POOL_DTYPES, AttentionBatch, attend
from computed.backends import AttentionBackend
from computed.kv_pool import KVPool
from computed.output_rows import OutputRows


@dataclass(frozen=True)
class NativeLayer:
    """One decoder layer's tensors: norms' weights, packed products and their widths."""

    layer_idx: int
    input_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # packed (q_size + 2 * kv_size, hidden)
    qkv_bias: torch.Tensor | None  # (q_size + 2 * kv_size,) Qwen2's biases, or None
    q_norm: torch.Tensor | None  # (head_dim,) Qwen3's per-head norms, or None
    k_norm: torch.Tensor | None
    o: torch.Tensor  # packed (hidden, q_size)
    post_norm: torch.Tensor  # (hidden,)
    gate_up: torch.Tensor  # packed (2 * intermediate, hidden)
    down: torch.Tensor  # packed (hidden, intermediate)
    gate_up_size: int  # 2 * intermediate
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


@dataclass(frozen=True)
class NativeForward:
    """`CausalLM.forward` and `compute_logits` on CPU float32 by the native kernels only."""

    embed: torch.Tensor  # (vocab, hidden)
    layers: tuple[NativeLayer, ...]
    final_norm: torch.Tensor  # (hidden,)
    lm_head: torch.Tensor  # packed (vocab, hidden)
    hidden_size: int
    vocab_size: int
    eps: float
    rotary: torch.nn.Module  # the model's RotaryEmbedding (its cos/sin tables)
    ops: tuple[Callable, Callable]  # rms_norm, packed_linear
    # layer_qkv, layer_out (computed/kernels/layer.cpp): a layer's ops before and after its
    # attention, each one call (a layer's Python between its ops was 26% of a decode step).
    # A layer whose intermediate size is a multiple of 32 runs its gate/up product and
    # activation as one op (packed_linear_swiglu, bit for bit the two; the (T, 2I) product
    # never reaches memory: a 2,048-token prefill step 3-6% faster, packed_linear.cpp says).
    layer_ops: tuple[Callable, Callable]
    # kvcache::forward_layers (computed/kernels/forward.cpp) and the layers' tensors as it
    # takes them, built once: a step's every layer, attention included, in one call where
    # the layers share their shapes and the native attention kernels take them (else None:
    # the loop below). Steps that read every row (decode steps) take it, and so do steps
    # whose last layer runs for their sampled rows only (prefill chunks: its read_rows); a
    # step that reads no row keeps the loop (its last layer only writes K/V). A standalone
    # decode burst, 8 rows x 1,100 keys, interleaved with the loop's build: 1.39-1.48 ->
    # 1.24-1.28 ms a step.
    whole: tuple[Callable, tuple] | None = None
    # The loop's attention (`CausalLM.use_attention_backend`); None asks the registry per call.
    # `whole` runs cpu_native's kernels itself: the registry's choice wherever `whole` can run.
    backend: AttentionBackend | None = None

    @classmethod
    def build(cls, model: torch.nn.Module) -> NativeForward | None:
        """From a fused, packed `CausalLM`; None where some part cannot run natively
        (another device or dtype, no kernels, an unfused or unpacked product)."""
        # The ops layer.cpp composes, each asked for: a caller can withhold one (the
        # native activations, tests/computed/test_model.py), and then none runs here.
        composed = (
            kernels.add_rms_norm(),
            kernels.rotary(),
            kernels.silu_mul(),
            kernels.packed_linear_swiglu(),
            kernels.write_kv(),
        )
        ops = (kernels.rms_norm(), kernels.packed_linear())
        layer_ops = (kernels.layer_qkv(), kernels.layer_out())
        if (
            any(op is None for op in (*composed, *ops, *layer_ops))
            or model.lm_head.packed is None
            or model.lm_head.bias is not None
        ):
            return None
        norms = [model.model.norm]
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv_packed is None or attn.o_proj.packed is None or attn.o_proj.bias is not None:
                return None
            if mlp.gate_up_packed is None or mlp.down_proj.packed is None:
                return None
            qk_norms = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else (None, None)
            norms += [layer.input_layernorm, layer.post_attention_layernorm, *filter(None, qk_norms)]
            layers.append(
                NativeLayer(
                    layer_idx=attn.layer_idx,
                    input_norm=layer.input_layernorm.weight.detach(),
                    qkv=attn.qkv_packed,
                    qkv_bias=attn.qkv_bias,
                    q_norm=None if qk_norms[0] is None else qk_norms[0].weight.detach(),
                    k_norm=None if qk_norms[1] is None else qk_norms[1].weight.detach(),
                    o=attn.o_proj.packed,
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    gate_up=mlp.gate_up_packed,
                    down=mlp.down_proj.packed,
                    gate_up_size=mlp.gate_up_weight.shape[0],
                    num_heads=attn.num_heads,
                    num_kv_heads=attn.num_kv_heads,
                    head_dim=attn.head_dim,
                    scale=attn.scale,
                )
            )
        # The norms' native kernel takes contiguous float32 weights (as RMSNorm.forward checks).
        if len({n.eps for n in norms}) != 1 or not all(
            n.weight.dtype == torch.float32 and n.weight.is_contiguous() for n in norms
        ):
            return None
        return cls(
            whole=cls._whole(layers, model.model.norm.weight.detach()),
            embed=model.model.embed_tokens.weight.detach(),
            layers=tuple(layers),
            final_norm=model.model.norm.weight.detach(),
            lm_head=model.lm_head.packed,
            hidden_size=model.config.hidden_size,
            vocab_size=model.config.vocab_size,
            eps=norms[0].eps,
            rotary=model.rotary,
            ops=(ops[0].default, ops[1].default),
            layer_ops=(layer_ops[0].default, layer_ops[1].default),
            backend=model.attention_backend,
        )

    @staticmethod
    def _whole(layers: list[NativeLayer], final_norm: torch.Tensor) -> tuple[Callable, tuple] | None:
        op = kernels.forward_layers()
        attention = (kernels.paged_decode(), kernels.paged_flash(), kernels.merge_partials())
        shapes = {(la.num_heads, la.num_kv_heads, la.head_dim, la.gate_up_size, la.scale) for la in layers}
        if op is None or any(a is None for a in attention) or len(shapes) != 1:
            return None
        num_heads, num_kv_heads, head_dim, gate_up_size, scale = shapes.pop()
        # paged_flash's limits (as backends.registry checks them).
        if head_dim % 8 != 0 or num_heads // num_kv_heads > 64:
            return None
        next_norms = [la.input_norm for la in layers[1:]] + [final_norm]
        flat = [
            t
            for la, next_norm in zip(layers, next_norms)
            for t in (la.qkv, la.o, la.post_norm, la.gate_up, la.down, next_norm)
        ]
        args = (
            flat,
            [la.qkv_bias for la in layers],
            [la.q_norm for la in layers],
            [la.k_norm for la in layers],
            [la.layer_idx for la in layers],
            num_heads,
            num_kv_heads,
            head_dim,
            gate_up_size,
            scale,
        )
        return op.default, args

    def forward(
        self, input_ids: torch.Tensor, batch: AttentionBatch, pool: KVPool, read: OutputRows | None = None
    ) -> torch.Tensor:
        """input_ids (T,) -> final-normed hidden (T, hidden), writing the new K/V into `pool`;
        with `read`, the hidden states of its rows only (S, hidden), the last layer run past
        its q/k/v product for those rows alone (see `computed.output_rows`).

        Each residual add runs with the norm after it (`add_rms_norm`: the sum as torch adds,
        then the same norm), so a layer is its modules' `x + attn(norm(x))`, then
        `x + mlp(norm(x))`, with the next layer's input norm (or the final one) taken last."""
        rms = self.ops[0]
        layer_qkv, layer_out = self.layer_ops
        eps = self.eps
        x = self.embed.index_select(0, input_ids)  # (T, hidden): the residual stream
        cos, sin = self.rotary.cos_sin(batch.positions, batch.max_position, x.dtype)  # (T, D) each
        h = rms(x, self.layers[0].input_norm, eps)
        # Every token's K/V is written but a fully cached prompt's recomputed last position.
        writes_all = batch.write_slots.shape[0] == batch.num_tokens and not batch.write_rows_selected
        write_index = None if writes_all else batch.write_token_index
        read_any = read is None or read.batch is not None
        if read_any and self.whole is not None and pool.kv.dtype in NATIVE_POOL_DTYPES:
            op, args = self.whole
            tiles, causal, in_order = batch.native_tiles
            reads = (None, [], [], [], None)
            if read is not None and read.batch is not None:
                reads = (read.rows, *read.batch.native_tiles, read.batch.merge_index)
            return op(
                x, h, *args, eps, cos, sin, pool.kv, batch.write_slots, write_index, tiles, causal, in_order,
                batch.merge_index, *reads,
            )  # fmt: skip
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        for layer, next_norm in zip(self.layers, next_norms):
            q = layer_qkv(
                h,
                layer.qkv,
                layer.qkv_bias,
                layer.q_norm,
                layer.k_norm,
                cos,
                sin,
                pool.kv,
                layer.layer_idx,
                batch.write_slots,
                write_index,
                layer.num_heads,
                layer.num_kv_heads,
                layer.head_dim,
                eps,
            )  # (T, H, D), the new K/V in the pool
            if read is not None and layer is self.layers[-1]:
                if read.batch is None:
                    return h.new_empty(0, self.hidden_size)
                q, x = q.index_select(0, read.rows), x.index_select(0, read.rows)  # (S, H, D), (S, hidden)
                out = attend(q, layer.layer_idx, read.batch, pool, layer.scale, self.backend)  # (S, H, D)
            else:
                out = attend(q, layer.layer_idx, batch, pool, layer.scale, self.backend)  # (T, H, D)
            h, x = layer_out(
                out,
                x,
                layer.o,
                layer.post_norm,
                layer.gate_up,
                layer.down,
                next_norm,
                layer.gate_up_size,
                eps,
            )
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, hidden) -> float32 logits (N, vocab)."""
        return self.ops[-1](hidden.contiguous(), self.lm_head, None, self.vocab_size)
