"""One daemon per port (issue 43): a second blockd or computed started on an address
another process already listens on fails with "address in use" and exits non-zero,
instead of sharing the port through SO_REUSEPORT (where `kvctl pools` answered from
whichever process the kernel picked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc

from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc
from tests.daemons import REPO, start_blockd, start_computed


def _second(module: str, listen: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    ready = tmp_path / f"second-{module}.ready"
    command = [sys.executable, "-m", module, "--listen", listen, "--ready-file", str(ready), *args]
    result = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert not ready.exists(), "the second daemon said it was ready"
    return result


def _pool_count(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        admin = pb_grpc.DirectoryAdminServiceStub(channel)
        return len(admin.ListPools(pb.ListPoolsRequest(), timeout=10).pools)


def test_a_second_blockd_on_a_taken_port_fails_with_address_in_use(tmp_path):
    first = start_blockd(tmp_path / "first")
    try:
        with grpc.insecure_channel(first.address) as channel:
            pb_grpc.BlockDirectoryServiceStub(channel).RegisterPool(
                pb.RegisterPoolRequest(num_blocks=8, block_size=4, namespace=pb.Namespace(model_id="m")),
                timeout=10,
            )
        second = _second("blockd", first.address, tmp_path)
        assert second.returncode != 0
        assert "address in use" in second.stdout + second.stderr, second.stdout + second.stderr
        assert first.is_alive()
        assert {_pool_count(first.address) for _ in range(8)} == {1}  # every call reaches the first
    finally:
        assert first.stop() == 0, first.log()


def test_a_second_computed_on_a_taken_port_fails_with_address_in_use(tmp_path, tiny_model):
    blockd = start_blockd(tmp_path)
    computed = start_computed(tmp_path, blockd.address, "--num-blocks", "32", model=tiny_model)
    try:
        args = ("--blockd", blockd.address, "--model", str(tiny_model), "--num-blocks", "32")
        second = _second("computed", computed.address, tmp_path, *args)
        assert second.returncode != 0
        assert "address in use" in second.stdout + second.stderr, second.stdout + second.stderr
        assert computed.is_alive() and _pool_count(blockd.address) == 1  # the second never registered
    finally:
        assert computed.stop() == 0, computed.log()
        assert blockd.stop() == 0, blockd.log()
