"""The native kernels as CPUs older than this one build them: the 8-lane (AVX2) paths and
the 16-lane paths without AVX512_BF16's dot products (an Ice Lake server). `-march=native`
only ever builds this machine's paths; each variant here is a build of its own (its own
TORCH_EXTENSIONS_DIR, COMPUTED_CPU_KERNEL_FLAGS) that must pass the same kernel tests, the
bit-for-bit bfloat16 ones included."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from computed import kernels
from tests.daemons import REPO

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not kernels.has_compiler(),
    reason="the variants are x86 builds and need a C++ compiler",
)

KERNEL_TESTS = ["tests/computed/test_kernels.py", "tests/computed/test_kernels_bf16_pool.py"]


@pytest.mark.parametrize(
    ("flags", "absent"),
    [
        pytest.param("-mno-avx512bf16", "vdpbf16ps", id="avx512-without-bf16"),
        pytest.param("-mno-avx512f", "zmm", id="avx2"),
    ],
)
def test_kernel_tests_pass_on_an_older_isa(flags: str, absent: str, tmp_path: Path) -> None:
    """`absent`: what the variant's library must not contain (it was built without it)."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), kernels.FLAGS_ENV: flags}
    env.pop(kernels.ENV, None)

    def run(*args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args],
            check=False,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    built = run("-c", "from computed import kernels; print(kernels.error())", timeout=600)
    assert built.stdout.strip() == "None", f"the {flags} build failed: {built.stdout}{built.stderr}"
    library = next((tmp_path / "ext").rglob("kvcache_cpu*.so"))
    code = subprocess.run(["objdump", "-d", str(library)], check=True, capture_output=True, text=True).stdout
    assert absent not in code, f"the {flags} build still has {absent}"
    tested = run("-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS, timeout=600)
    assert tested.returncode == 0, f"{flags}:\n{tested.stdout[-6000:]}{tested.stderr[-2000:]}"
    assert " skipped" not in tested.stdout.splitlines()[-1], tested.stdout[-2000:]
