"""blockd's compiled core (blockd/native.py): the daemon runs it where its build is current,
never a stale one, and says which core runs. The directory's behaviour on it is checked by
running tests/blockd on it (`make test-native`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from blockd import native
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc
from tests.daemons import REPO, start_blockd


@pytest.fixture(scope="module")
def built() -> Path:
    """The current build (`make install` made it; a no-op then, else ~30 s)."""
    return native.build()


def _core_line(log: Path) -> dict:
    for line in log.read_text().splitlines():
        if '"directory core"' in line:
            return json.loads(line)
    raise AssertionError(f"no 'directory core' line in {log.read_text()}")


def _metrics_address(log: Path) -> str:
    for line in log.read_text().splitlines():
        if '"serving"' in line:
            return json.loads(line)["metrics"]
    raise AssertionError(f"no 'serving' line in {log.read_text()}")


def _admit_and_release(address: str) -> int:
    """One admission of 64 tokens, committed and released; answers its cached tokens
    on a second admission of the same prompt."""
    tokens = list(range(64))
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.BlockDirectoryServiceStub(channel)
        reg = stub.RegisterPool(
            pb.RegisterPoolRequest(
                num_blocks=32,
                block_size=16,
                namespace=pb.Namespace(model_id="m", model_revision="r", dtype="float32"),
                worker_address="test:0",
            )
        )
        first = stub.Step(
            pb.StepRequest(
                pool_id=reg.pool_id, epoch=reg.epoch, admits=[pb.AdmitOp(sequence_id=1, token_ids=tokens)]
            )
        ).admits[0]
        stub.Step(
            pb.StepRequest(
                pool_id=reg.pool_id,
                epoch=reg.epoch,
                commits=[pb.CommitOp(sequence_id=1, block_ids=first.block_ids, token_ids=tokens)],
                releases=[pb.ReleaseOp(sequence_id=1)],
            )
        )
        again = stub.Step(
            pb.StepRequest(
                pool_id=reg.pool_id, epoch=reg.epoch, admits=[pb.AdmitOp(sequence_id=2, token_ids=tokens)]
            )
        ).admits[0]
        return again.num_cached_tokens


@pytest.mark.parametrize("mode, compiled", [("on", True), ("auto", True), ("off", False)])
def test_the_daemon_runs_the_core_its_mode_asks_for_and_serves_the_same(built, tmp_path, mode, compiled):
    env = {"BLOCKD_NATIVE": mode, "BLOCKD_LOG_FORMAT": "json"}
    daemon = start_blockd(tmp_path, "--metrics-port", "0", env=env)
    try:
        assert _admit_and_release(daemon.address) == 64
        metrics = urllib.request.urlopen(f"http://{_metrics_address(daemon.log_path)}/metrics", timeout=10)
        text = metrics.read().decode()
    finally:
        assert daemon.stop() == 0
    line = _core_line(daemon.log_path)
    assert line["compiled"] is compiled
    if compiled:
        assert line["detail"] == str(built)
    core = "compiled" if compiled else "pure"
    assert f'kvcache_directory_core{{core="{core}"}} 1.0' in text


def test_without_a_build_of_these_sources_auto_runs_pure_and_on_refuses(tmp_path):
    empty = tmp_path / "no-build"
    env = {"BLOCKD_NATIVE_BUILD_DIR": str(empty), "BLOCKD_LOG_FORMAT": "json"}
    daemon = start_blockd(tmp_path, env={**env, "BLOCKD_NATIVE": "auto"})
    try:
        assert _admit_and_release(daemon.address) == 64
    finally:
        assert daemon.stop() == 0
    line = _core_line(daemon.log_path)
    assert line["compiled"] is False and "make native" in line["detail"]
    refused = subprocess.run(
        [sys.executable, "-m", "blockd", "--listen", "127.0.0.1:0"],
        cwd=REPO,
        env={**os.environ, **env, "BLOCKD_NATIVE": "on"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2
    assert "BLOCKD_NATIVE" in refused.stderr and "make native" in refused.stderr


def test_a_bad_mode_exits_2_and_names_the_choices():
    done = subprocess.run(
        [sys.executable, "-m", "blockd", "--listen", "127.0.0.1:0"],
        cwd=REPO,
        env={**os.environ, "BLOCKD_NATIVE": "fast"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "auto, on, off" in done.stderr


def test_an_edited_source_has_another_build_key(tmp_path, monkeypatch):
    copies = []
    for path in native.sources():
        copy = tmp_path / path.name
        shutil.copy2(path, copy)
        copies.append(copy)
    monkeypatch.setattr(native, "sources", lambda: copies)
    before = native.build_key()
    assert native.build_key() == before
    copies[0].write_text(copies[0].read_text() + "\n# edited\n")
    assert native.build_key() != before


def _python(code: str) -> list[str]:
    """The lines a fresh interpreter prints running `code` (its blockd imports are its own)."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.strip().splitlines()


def test_the_core_cannot_be_switched_after_it_was_imported(built):
    code = (
        "import blockd.pool\n"
        "from blockd import native\n"
        "print(native.enable('auto'))\n"
        "try:\n"
        "    native.enable('on')\n"
        "except native.NativeUnavailable as exc:\n"
        "    print('refused:', exc)\n"
    )
    first, second = _python(code)
    assert first.startswith("off: blockd.") and "imported before enable()" in first
    assert second.startswith("refused:")


def test_the_compiled_modules_are_the_ones_loaded(built):
    code = (
        "from blockd import native\n"
        "print(native.enable('on'))\n"
        "import blockd.directory, blockd.pool, blockd.eviction\n"
        "print(native.is_enabled(), blockd.pool.__file__)\n"
    )
    status, loaded = _python(code)
    assert status == f"on: {built}"
    enabled, path = loaded.split(" ", 1)
    assert enabled == "True" and path.startswith(str(built)) and path.endswith(".so")
