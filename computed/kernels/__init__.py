"""Native CPU kernels, built with torch's C++ extension tooling on first use.

Each accessor answers the `torch.ops.kvcache` op of its name: `paged_decode()`
(paged_decode.cpp), `paged_flash()` and `flash_gather_keys()` (paged_flash.cpp), `pack_linear_weight()`,
`pack_linear_weight_bf16()`, `pack_linear_weight_bf16_dot()` and `packed_linear()` (packed_linear.cpp), `rotary()` (rotary.cpp), `rms_norm()` and
`add_rms_norm()` (rms_norm.cpp), `merge_partials()` (merge.cpp), `silu_mul()`
(silu_mul.cpp), `argmax_rows()` (argmax.cpp), `write_kv()` (kv_write.cpp), and
`layer_qkv()` and `layer_out()` (layer.cpp: a decoder layer's ops around its attention),
`forward_layers()` (forward.cpp: every layer of a step, attention included), and
`parallel_visits()` (parallel_probe.cpp: how the kernels' parallel loop, parallel.h, ran a
range; for tests); or None
where they cannot be built (no C++ compiler, no ninja, not Linux x86/arm, or
`COMPUTED_CPU_KERNELS=0`): callers then keep torch's own kernels, which give the same
results (attention, linear, norms and activation up to float rounding, rotary bit for
bit).

The build (about a minute on two cores) goes to a folder of its own keyed by everything that
changes the library: the sources and headers, the compiler flags, the compiler, torch's and
Python's versions and the CPU's instruction sets (`build_dir()`). The folder lies under the
checkout's `build/kernels/` (or `COMPUTED_KERNEL_BUILD_DIR`, else `TORCH_EXTENSIONS_DIR`,
else `~/.cache/kvcache/kernels` for an installed package), so two checkouts never rebuild
each other's kernels, and a start that finds the folder's library complete loads it without
running the compiler or ninja at all. `make install` builds it ahead (`python -m
computed.kernels`), so a daemon's start-up only loads it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SOURCES = tuple(
    HERE / name
    for name in (
        "paged_decode.cpp",
        "paged_flash.cpp",
        "packed_linear.cpp",
        "rotary.cpp",
        "rms_norm.cpp",
        "merge.cpp",
        "silu_mul.cpp",
        "argmax.cpp",
        "kv_write.cpp",
        "layer.cpp",
        "forward.cpp",
        "parallel_probe.cpp",
    )
)
ENV = "COMPUTED_CPU_KERNELS"
# Extra compiler flags for the build, after -march=native: "-mno-avx512f" builds the
# 8-lane (AVX2) paths, "-mno-avx512bf16" the 16-lane ones without the bfloat16 dot
# products, as an older CPU would run them (tests/computed/test_kernel_isas.py). They are
# part of the build folder's key, so each variant builds apart from the others.
FLAGS_ENV = "COMPUTED_CPU_KERNEL_FLAGS"
BUILD_DIR_ENV = "COMPUTED_KERNEL_BUILD_DIR"
NAME = "kvcache_cpu"
# Written after a build loaded: a library without it may still be half linked.
_DONE = "built"


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no")


def has_compiler() -> bool:
    """A C++ compiler is installed (`CXX`, else `c++`): then the kernel must build."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def paged_decode() -> Callable | None:
    """The paged decode op, built or loaded once per process (the first call waits for it);
    None where it cannot be had (`error()` says why)."""
    return torch.ops.kvcache.paged_decode if _loaded()[0] else None


def paged_flash() -> Callable | None:
    """The paged flash op for tiles of several query rows per item (`paged_flash(q, keys,
    values, key_slots, key_lens, causal, scale) -> (out, lse)`), or None as `paged_decode()`."""
    return torch.ops.kvcache.paged_flash if _loaded()[0] else None


def pack_linear_weight() -> Callable | None:
    """The weight packing op for `packed_linear` (`pack_linear_weight(weight) -> packed`),
    or None as `paged_decode()`."""
    return torch.ops.kvcache.pack_linear_weight if _loaded()[0] else None


def pack_linear_weight_bf16() -> Callable | None:
    """The half-size packing for a weight whose every value is a bfloat16
    (`pack_linear_weight_bf16(weight) -> packed`, refused otherwise; `packed_linear` gives
    bit for bit what it gives from `pack_linear_weight`), or None as `paged_decode()`."""
    return torch.ops.kvcache.pack_linear_weight_bf16 if _loaded()[0] else None


def pack_linear_weight_bf16_dot() -> Callable | None:
    """The packing for products in bfloat16 (`pack_linear_weight_bf16_dot(weight) -> packed`,
    a bfloat16 weight in pairs: `packed_linear` then rounds x to bfloat16 and sums the
    products in float32, by AVX512_BF16's dot instruction where the machine has it), or None
    as `paged_decode()`."""
    return torch.ops.kvcache.pack_linear_weight_bf16_dot if _loaded()[0] else None


def packed_linear() -> Callable | None:
    """The linear op on a packed weight (`packed_linear(x, packed, bias, n) -> y`, float32
    rounding of `torch.nn.functional.linear`, each row independent of the batch), or None
    as `paged_decode()`."""
    return torch.ops.kvcache.packed_linear if _loaded()[0] else None


def packed_linear_swiglu() -> Callable | None:
    """SwiGLU's product and activation in one op on a packed fused gate/up weight
    (`packed_linear_swiglu(x, packed, n) -> silu(gate) * up`, n = 2 x intermediate, the
    intermediate a multiple of 16: bit for bit `silu_mul()` of `packed_linear()`), or None
    as `paged_decode()`."""
    return torch.ops.kvcache.packed_linear_swiglu if _loaded()[0] else None


def flash_gather_keys() -> Callable | None:
    """`flash_gather_keys(head_dim, bfloat16_pool) -> int`: how many keys at a time
    `paged_flash()` copies K/V out of the pool for that head size and pool dtype in this
    build: 16 (AVX-512; AVX512_BF16 for a bfloat16 pool), 8 (AVX2) or 1; or None as
    `paged_decode()`."""
    return torch.ops.kvcache.flash_gather_keys if _loaded()[0] else None


def parallel_visits() -> Callable | None:
    """`parallel_visits(n, grain) -> (visits, threads)`: each index's run count and the
    threads that ran chunks of the kernels' parallel loop (parallel.h), or None as
    `paged_decode()`. For tests."""
    return torch.ops.kvcache.parallel_visits if _loaded()[0] else None


def rotary() -> Callable | None:
    """The rotary op (`rotary(q, k, cos, sin) -> (q, k)`, bit-identical to
    `computed.model.rope.apply_rotary` on CPU float32), or None as `paged_decode()`."""
    return torch.ops.kvcache.rotary if _loaded()[0] else None


def rms_norm() -> Callable | None:
    """The RMSNorm op (`rms_norm(x, weight, eps)`, float32 rounding of
    `computed.model.layers.RMSNorm`'s torch ops), or None as `paged_decode()`."""
    return torch.ops.kvcache.rms_norm if _loaded()[0] else None


def add_rms_norm() -> Callable | None:
    """A residual add and the RMSNorm after it (`add_rms_norm(x, residual, weight, eps) ->
    (norm, sum)`, bit for bit `rms_norm()` of `x + residual`), or None as `paged_decode()`."""
    return torch.ops.kvcache.add_rms_norm if _loaded()[0] else None


def merge_partials() -> Callable | None:
    """The merge op for rows read through several tiles (`merge_partials(outs, lses, index)
    -> out`, the log-sum-exp weighted mean of each row's partials), or None as
    `paged_decode()`."""
    return torch.ops.kvcache.merge_partials if _loaded()[0] else None


def silu_mul() -> Callable | None:
    """SwiGLU's activation from the fused gate/up product (`silu_mul(x) -> silu(gate) *
    up`, float32 rounding of torch's two ops), or None as `paged_decode()`."""
    return torch.ops.kvcache.silu_mul if _loaded()[0] else None


def argmax_rows() -> Callable | None:
    """Greedy sampling's argmax (`argmax_rows(x) -> index`, each row's first maximum, a NaN
    counting as the maximum: exactly `torch.argmax(x, dim=-1)`), or None as `paged_decode()`."""
    return torch.ops.kvcache.argmax_rows if _loaded()[0] else None


def write_kv() -> Callable | None:
    """The pool write of a step's new K/V (`write_kv(keys, values, k, v, slots)`, in place:
    row t of k and v into slot slots[t], what two `index_copy_` calls do), or None as
    `paged_decode()`."""
    return torch.ops.kvcache.write_kv if _loaded()[0] else None


def layer_qkv() -> Callable | None:
    """A decoder layer's ops before its attention (`layer_qkv(h, qkv, bias, q_norm, k_norm,
    cos, sin, kv, layer, write_slots, write_index, num_heads, num_kv_heads, head_dim, eps) ->
    q`: the q/k/v product, the q/k norms if any, rotary, the new K/V written into the pool),
    bit for bit those ops one by one, or None as `paged_decode()`."""
    return torch.ops.kvcache.layer_qkv if _loaded()[0] else None


def layer_out() -> Callable | None:
    """A decoder layer's ops after its attention (`layer_out(attn, x, o, post_norm, gate_up,
    down, next_norm, gate_up_size, eps) -> (h, x)`: the output product and residual add with
    the norm after it, the MLP and its add with the next norm), bit for bit those ops one by
    one, or None as `paged_decode()`."""
    return torch.ops.kvcache.layer_out if _loaded()[0] else None


def forward_layers() -> Callable | None:
    """Every decoder layer of a step in one call (`forward_layers(x, h, layers, bias, q_norm,
    k_norm, layer_ids, num_heads, num_kv_heads, head_dim, gate_up_size, scale, eps, cos, sin,
    kv, write_slots, write_index, tiles, causal, in_order, merge_index) -> h`: layer_qkv, the
    attention of every tile by paged_decode or paged_flash, merged or placed, then layer_out,
    per layer), bit for bit those ops one by one, or None as `paged_decode()`."""
    return torch.ops.kvcache.forward_layers if _loaded()[0] else None


def error() -> str | None:
    """Why the ops are None (None when they loaded)."""
    return _loaded()[1]


def cflags() -> list[str]:
    # -fopenmp: at::parallel_for runs on torch's OpenMP pool (the same libgomp);
    # -march=native: AVX2/AVX-512 for the dot products (built on the machine that runs it).
    return ["-O3", "-fopenmp", "-march=native", *os.environ.get(FLAGS_ENV, "").split()]


def build_root() -> Path:
    """Where the keyed build folders live: `COMPUTED_KERNEL_BUILD_DIR`, else
    `TORCH_EXTENSIONS_DIR`, else the checkout's `build/kernels` (git ignores `/build/`), else
    (an installed package) the user's cache."""
    for env in (BUILD_DIR_ENV, "TORCH_EXTENSIONS_DIR"):
        if os.environ.get(env):
            return Path(os.environ[env])
    checkout = HERE.parents[1]
    if (checkout / "pyproject.toml").is_file() and os.access(checkout, os.W_OK):
        return checkout / "build" / "kernels"
    return Path.home() / ".cache" / "kvcache" / "kernels"


def build_key() -> str:
    """A digest of everything the library depends on: equal keys mean a library built for one
    serves the other (so checkouts with the same sources may share a root safely)."""
    digest = hashlib.sha256()
    for path in sorted([*HERE.glob("*.cpp"), *HERE.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    compiler = shutil.which(os.environ.get("CXX", "c++")) or ""
    facts = [
        " ".join(cflags()),
        os.path.realpath(compiler) if compiler else "",
        torch.__version__,
        sys.version,
        platform.machine(),
        _cpu_flags(),
    ]
    digest.update("\0".join(facts).encode())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    """This build's folder: `build_root() / build_key()`."""
    return build_root() / build_key()


def _cpu_flags() -> str:
    """The CPU's instruction sets (a -march=native library may not run on another CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


@functools.cache
def _loaded() -> tuple[bool, str | None]:
    return _load()


def _load() -> tuple[bool, str | None]:
    if not enabled():
        return False, f"{ENV}=0"
    if hasattr(torch.ops, "kvcache") and hasattr(torch.ops.kvcache, "forward_layers"):
        return True, None
    try:
        folder = build_dir()
        library = folder / f"{NAME}.so"
        if (folder / _DONE).is_file() and library.is_file():
            # Built before for exactly these sources, flags, compiler and CPU: no ninja run.
            torch.ops.load_library(str(library))
            return True, None
        from torch.utils import cpp_extension

        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=NAME,
            sources=[str(source) for source in SOURCES],
            extra_cflags=cflags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
        (folder / _DONE).write_text(" ".join(cflags()) + "\n")
    except Exception as exc:  # noqa: BLE001 - any build failure means: use torch's kernels
        return False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    return True, None
