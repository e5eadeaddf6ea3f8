"""Which attention backend runs, decided once from what the model runs on.

`select_attention_backend` answers the backend and why; `ModelRunner` asks it once when
the model loads (and logs the answer), the model then hands that backend to every layer.
Direct callers of `computed.attention` that pass none get the same answer asked afresh
(tests that withhold a kernel see it withheld). A new backend is a module in this package
and one entry in `_ENTRIES`, tried in order: the first that applies wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from computed import kernels, triton_attention
from computed.backends import AttentionBackend
from computed.backends.cpu_native import CpuNative
from computed.backends.cuda_triton import CudaTriton
from computed.backends.torch_portable import TorchPortable

# The pool dtypes the native CPU attention kernels read (bfloat16 widened on load, exactly).
NATIVE_POOL_DTYPES = (torch.float32, torch.bfloat16)

# torch's fused CPU attention that also returns the log-sum-exp the merge needs.
CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True)
class AttentionTarget:
    """What a backend is chosen for: the queries' device and dtype, the pool's dtype and
    the head shape (query heads per K/V head, head size)."""

    device: torch.device
    dtype: torch.dtype  # the model's: queries and new K/V
    pool_dtype: torch.dtype
    head_dim: int
    group: int


@dataclass(frozen=True)
class BackendChoice:
    backend: AttentionBackend
    reason: str


def select_attention_backend(
    target: AttentionTarget, cpu_flash: Callable | None = CPU_FLASH
) -> BackendChoice:
    """The first backend of `_ENTRIES` that applies to `target` (torch_portable always does).
    `cpu_flash`: torch's CPU flash op, or None to keep to matmuls off the native kernels."""
    for entry in _ENTRIES:
        choice = entry(target, cpu_flash)
        if choice is not None:
            return choice
    raise AssertionError("torch_portable applies everywhere")


def _cuda_triton(target: AttentionTarget, cpu_flash: Callable | None) -> BackendChoice | None:
    if target.device.type != "cuda" or target.dtype != target.pool_dtype:
        return None  # the kernel's products take queries and keys of one dtype
    if not triton_attention.supports(target.head_dim, target.group):
        return None
    flash = triton_attention.paged_flash()
    if flash is None:
        return None
    return BackendChoice(CudaTriton(flash), f"cuda, triton kernel for head_dim={target.head_dim}")


def _cpu_native(target: AttentionTarget, cpu_flash: Callable | None) -> BackendChoice | None:
    if not _native_cpu_dtypes(target):
        return None
    decode = kernels.paged_decode()
    # The flash op takes head sizes that are a multiple of 8 and at most 64 query heads per K/V head.
    takes_heads = target.head_dim % 8 == 0 and target.group <= 64
    flash = kernels.paged_flash() if takes_heads else None
    if decode is None and flash is None:
        return None
    reason = f"cpu, float32 model, {target.pool_dtype} pool, native kernels built"
    if flash is None:
        reason += f" (flash op off for head_dim={target.head_dim} group={target.group}: torch's)"
    return BackendChoice(CpuNative(decode, flash, _portable(target, cpu_flash)), reason)


def _torch_portable(target: AttentionTarget, cpu_flash: Callable | None) -> BackendChoice:
    backend = _portable(target, cpu_flash)
    if target.device.type == "cuda":
        why = (
            f"cuda, no triton kernel for head_dim={target.head_dim} group={target.group}, "
            f"{target.dtype} model, {target.pool_dtype} pool"
        )
    elif target.device.type == "cpu" and _native_cpu_dtypes(target):
        why = f"cpu, native kernels not built ({kernels.error()})"
    else:
        why = f"{target.device.type}, {target.dtype} model, {target.pool_dtype} pool"
    return BackendChoice(backend, why + ("; torch's cpu flash" if backend.cpu_flash else "; float32 matmuls"))


def _portable(target: AttentionTarget, cpu_flash: Callable | None) -> TorchPortable:
    on_cpu = target.device.type == "cpu"
    float32 = target.dtype == target.pool_dtype == torch.float32
    return TorchPortable(
        cpu_flash=cpu_flash if on_cpu and float32 else None,
        native_write=kernels.write_kv() if _native_cpu_dtypes(target) else None,
        native_merge=kernels.merge_partials() if on_cpu else None,
    )


def _native_cpu_dtypes(target: AttentionTarget) -> bool:
    return (
        target.device.type == "cpu"
        and target.dtype == torch.float32
        and target.pool_dtype in NATIVE_POOL_DTYPES
    )


_ENTRIES = (_cuda_triton, _cpu_native, _torch_portable)
