"""Building blocks shared by the Llama-family decoder layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from computed import kernels, triton_layers


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and names) whose product runs `kvcache::packed_linear`
    once `pack()` has packed its weight (see `linear`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("packed", None, persistent=False)

    def pack(self, products: torch.dtype = torch.float32) -> None:
        """Pack the weight for the native product (`pack_weight`); a no-op where that cannot run."""
        self.packed = pack_weight(self.weight, products)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def pack_weight(weight: torch.Tensor, products: torch.dtype = torch.float32) -> torch.Tensor | None:
    """`weight` (N, K) laid out for `kvcache::packed_linear` (panels of 16 output columns,
    K-major: a second copy of the weight), or None where the product cannot run natively
    (not CPU float32, or the native kernels did not load). Pack once the weight is final:
    the packed copy does not follow later changes to it.

    `products`: float32, or bfloat16 for products whose inputs are rounded to bfloat16 and
    summed in float32 (`--dtype bfloat16` on CPU: the weight rounded to bfloat16 and packed
    in pairs for AVX512_BF16's dot instruction, twice float32's products a cycle; see
    packed_linear.cpp).

    A float32 product's weight whose every value is a bfloat16 (a bf16 checkpoint, as the
    built-in model's, loaded as float32) packs at half the bytes, widened back exactly as the
    kernel reads it: the same products bit for bit. Why: a decode step reads its weights
    back from memory (the step's K/V reads evict them), and that read is a third of a small
    batch's products (`python -m bench.attention_kernels`, linear block, one layer's five
    products from cold caches on a 2-core Zen 4: 8 rows 0.34 -> 0.27 ms, 64 rows 1.36 ->
    1.24 ms)."""
    assert products in (torch.float32, torch.bfloat16), f"products in {products}"
    op = kernels.pack_linear_weight()
    if op is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    weight = weight.detach().contiguous()
    if products == torch.bfloat16:
        return kernels.pack_linear_weight_bf16_dot()(weight.to(torch.bfloat16))
    if torch.equal(weight.to(torch.bfloat16).float(), weight):
        return kernels.pack_linear_weight_bf16()(weight)
    return op(weight)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; by `kvcache::packed_linear` where `packed` is `weight`
    packed (`pack_weight`) and x is contiguous CPU float32 (M, K).

    Why native: this model family's products are short (K of a few hundred) and narrow, where
    MKL reaches a third to two thirds of this machine's float32 peak; the packed kernel
    holds a 6 x 16 (AVX-512: 8 x 16) block of outputs in registers for the whole of K (`python -m
    bench.attention_kernels`, linear block: a decode step's 64 rows through one layer's
    four products and the vocabulary projection 6.5 -> 4.4 ms from cold caches, 8 rows
    2.4 -> 1.6 ms). Each output is one multiply-add chain over K in order, so a row's
    result is the same whatever else is in the batch (batch invariance), and within float32
    rounding of `F.linear`, not bit for bit."""
    if (
        packed is not None
        and x.dim() == 2
        and x.dtype == torch.float32
        and x.is_contiguous()
        and x.device.type == "cpu"
    ):
        return kernels.packed_linear()(x, packed, bias, weight.shape[0])
    return F.linear(x, weight, bias)


def fuse_rows(*linears: Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding the output rows of `linears` in order, for one product
    where there were several; each Linear's parameters become views of it (same names and
    values, no second copy). Call once the model is on its device: moving it after
    would copy the parts apart. Per output column the product is the same dot product,
    so the fused result equals the separate ones bit for bit (MKL and `kvcache::packed_linear`).
    Why: a decode step reads every weight from memory (they are evicted by the step's K/V
    reads); one weight is one stream where three were three, each paying a cold start
    (a recorded chat decode step 10.7 -> 10.3 ms, interleaved A/B; bit for bit the same tokens)."""
    weight = torch.cat([part.weight for part in linears])
    has_bias = linears[0].bias is not None
    assert all((part.bias is not None) == has_bias for part in linears), (
        "fuse linears with or without bias alike"
    )
    bias = torch.cat([part.bias for part in linears]) if has_bias else None
    start = 0
    for part in linears:
        rows = slice(start, start + part.out_features)
        part.weight = nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            part.bias = nn.Parameter(bias[rows], requires_grad=False)
        start += part.out_features
    return weight, bias


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back (as Hugging Face does);
    float32 CPU inputs in one native call (`kvcache::rms_norm`: the same arithmetic, its own
    summation order), where torch dispatches seven ops."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.triton_ops = False  # one Triton kernel (computed.triton_layers): CausalLM.use_triton_layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton_ops:
            return triton_layers.rms_norm(x, self.weight, self.eps)
        if (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.is_contiguous()
            and self.weight.dtype == torch.float32
            and self.weight.is_contiguous()
        ):
            op = kernels.rms_norm()
            if op is not None:
                return op(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); HF names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.intermediate_size = intermediate_size
        # (2 * intermediate, hidden): gate's rows, then up's, once `fuse()` ran; packed by `pack()`.
        self.register_buffer("gate_up_weight", None, persistent=False)
        self.register_buffer("gate_up_packed", None, persistent=False)
        self.triton_ops = False  # the activation as one Triton kernel (computed.triton_layers)

    def fuse(self) -> None:
        """Gate and up as one product (see `fuse_rows`)."""
        self.gate_up_weight, _ = fuse_rows(self.gate_proj, self.up_proj)

    def pack(self, products: torch.dtype = torch.float32) -> None:
        """Pack the weights of the products `forward` runs (see `pack_weight`)."""
        if self.gate_up_weight is None:
            self.gate_proj.pack(products)
            self.up_proj.pack(products)
        else:
            self.gate_up_packed = pack_weight(self.gate_up_weight, products)
        self.down_proj.pack(products)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if (
            self.gate_up_packed is not None
            and self.intermediate_size % 16 == 0
            and x.dim() == 2
            and x.dtype == torch.float32
            and x.is_contiguous()
            and x.device.type == "cpu"
        ):
            # The activation in the product's epilogue: the (T, 2 * intermediate) product never
            # reaches memory (`kvcache::packed_linear_swiglu`, bit for bit the two ops below).
            op = kernels.packed_linear_swiglu()
            if op is not None:
                return self.down_proj(op(x, self.gate_up_packed, 2 * self.intermediate_size))
        gate_up = linear(x, self.gate_up_weight, None, self.gate_up_packed)  # (T, 2 * intermediate)
        if self.triton_ops and gate_up.dim() == 2:
            return self.down_proj(triton_layers.silu_mul(gate_up))
        if gate_up.dtype == torch.float32 and gate_up.device.type == "cpu" and gate_up.dim() == 2:
            op = kernels.silu_mul()
            if op is not None:  # one pass, where torch takes two ops over strided halves
                return self.down_proj(op(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
