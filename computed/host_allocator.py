"""Keep large host buffers in glibc's heap instead of fresh mmap()s (CPU serving).

glibc serves an allocation above its mmap threshold (128 KiB to 32 MiB, adaptive) with a
fresh mapping and unmaps it on free, so every large activation or K/V gather of every
layer pays page faults on first touch. Raising the thresholds lets freed buffers be
reused. Measured (`python -m bench.attention_kernels --default-malloc` against without the
flag): gathering 64 sequences x 1,152 slots of K went from 25 ms to 6.5 ms. The transformers
baseline of the benchmarks calls this too, so both sides of that ratio run with it.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Buffers up to 1 GiB come from the heap (a step's K/V gathers reach tens of MiB), and a trim
# threshold that keeps up to 1 GiB of freed heap for reuse.
MMAP_THRESHOLD_BYTES = 1024 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024  # mallopt takes a C int


def keep_large_buffers() -> bool:
    """Set the thresholds in this process; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
