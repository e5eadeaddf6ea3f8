"""The native kernels' build folder: private to the checkout, keyed by what the library
depends on, and a start that finds it built loads it without running the builder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from computed import kernels
from tests.daemons import REPO


def _without_build_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in (kernels.BUILD_DIR_ENV, "TORCH_EXTENSIONS_DIR", kernels.FLAGS_ENV):
        monkeypatch.delenv(env, raising=False)


def test_the_default_root_is_the_checkouts_own(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_build_env(monkeypatch)
    assert kernels.build_root() == REPO / "build" / "kernels"
    assert kernels.build_dir().parent == REPO / "build" / "kernels"
    assert "/build/" in (REPO / ".gitignore").read_text().split(), "git must ignore the build folder"


def test_the_roots_can_be_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _without_build_env(monkeypatch)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch"))
    assert kernels.build_root() == tmp_path / "torch"
    monkeypatch.setenv(kernels.BUILD_DIR_ENV, str(tmp_path / "ours"))
    assert kernels.build_root() == tmp_path / "ours"


def test_the_key_follows_the_compiler_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_build_env(monkeypatch)
    key = kernels.build_key()
    assert key == kernels.build_key() and len(key) == 16
    monkeypatch.setenv(kernels.FLAGS_ENV, "-mno-avx512f")
    assert kernels.build_key() != key, "another ISA variant needs a library of its own"
    monkeypatch.delenv(kernels.FLAGS_ENV)
    assert kernels.build_key() == key


def test_the_key_follows_every_source_and_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _without_build_env(monkeypatch)
    copy = tmp_path / "kernels"
    copy.mkdir()
    for path in [*kernels.HERE.glob("*.cpp"), *kernels.HERE.glob("*.h")]:
        (copy / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(kernels, "HERE", copy)
    key = kernels.build_key()
    assert key == kernels.build_key()
    (copy / "vec.h").write_bytes((copy / "vec.h").read_bytes() + b"\n// changed\n")
    assert kernels.build_key() != key, "a header change must rebuild"


@pytest.mark.skipif(not kernels.has_compiler(), reason="the library is built only where a compiler is")
def test_a_start_finding_the_library_built_runs_no_builder() -> None:
    assert kernels.paged_decode() is not None, kernels.error()  # built (or loaded) here first
    env = {k: v for k, v in os.environ.items() if k != kernels.ENV}
    code = (
        "import sys; from computed import kernels; assert kernels.paged_decode() is not None, kernels.error(); "
        "print('torch.utils.cpp_extension' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", "the loader ran torch's builder for a library already built"
