"""Building blocks shared by the Llama-family decoder layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from computed import kernels


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and names) whose CPU float32 product runs
    `kvcache::linear` where the native kernels loaded (`computed/kernels/linear.cpp`): a
    decode step's few rows (at most 16) by a native dot-product kernel, each thread on its
    own block of output columns, where MKL streams the weights through one core (a chat
    decode step of the default model 18-23% less time; within float32 rounding of
    `F.linear`, and, up to 16 rows, a row's result independent of the rest of the batch); a wide output (the
    vocabulary projection) split by columns across torch's threads, bit-identical to
    `F.linear` (`python -m bench.attention_kernels`, linear block: 8 x 256 -> 4,096 1.26
    -> 0.69 ms). Elsewhere it is `F.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous():
            op = kernels.linear()
            if op is not None and self.weight.dtype == torch.float32 and self.weight.is_contiguous():
                return op(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back (as Hugging Face does);
    float32 CPU inputs in one native call (`kvcache::rms_norm`: the same arithmetic, its own
    summation order), where torch dispatches seven ops."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
