"""Native CPU kernels, built with torch's C++ extension tooling on first use.

`paged_decode()` answers the `torch.ops.kvcache.paged_decode` op (see paged_decode.cpp),
or None where it cannot be built (no C++ compiler, no ninja, not Linux x86/arm, or
`COMPUTED_CPU_KERNELS=0`): callers then keep torch's own kernels, which give the same
results up to float rounding. The build (about a minute on two cores) is cached under
torch's extensions directory (`TORCH_EXTENSIONS_DIR`); `make install` builds it ahead
(`python -m computed.kernels`), so a daemon's start-up only loads it.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "paged_decode.cpp"
ENV = "COMPUTED_CPU_KERNELS"


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no")


def has_compiler() -> bool:
    """A C++ compiler is installed (`CXX`, else `c++`): then the kernel must build."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def paged_decode() -> Callable | None:
    """The op, built or loaded once per process (the first call waits for it); None where it
    cannot be had (`error()` says why)."""
    return _loaded()[0]


def error() -> str | None:
    """Why `paged_decode()` is None (None when it loaded)."""
    return _loaded()[1]


@functools.cache
def _loaded() -> tuple[Callable | None, str | None]:
    return _load()


def _load() -> tuple[Callable | None, str | None]:
    if not enabled():
        return None, f"{ENV}=0"
    if hasattr(torch.ops, "kvcache") and hasattr(torch.ops.kvcache, "paged_decode"):
        return torch.ops.kvcache.paged_decode, None
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name="kvcache_paged_decode",
            sources=[str(SOURCE)],
            # -fopenmp: at::parallel_for runs on torch's OpenMP pool (the same libgomp);
            # -march=native: AVX2/AVX-512 for the dot products (built on the machine that runs it).
            extra_cflags=["-O3", "-fopenmp", "-march=native"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure means: use torch's kernels
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    return torch.ops.kvcache.paged_decode, None
