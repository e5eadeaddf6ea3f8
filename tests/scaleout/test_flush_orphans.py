"""A shared-tier write under way during a Flush lands after it: blockd deletes the key it
left once the worker reports it (the report names a write the flush forgot), so a flushed
block never comes back with the next rebuild. Real blockd, real valkey-server."""

from __future__ import annotations

import time

import grpc
import pytest
import valkey

from clients.spawn import start_valkey, valkey_server_binary
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc
from kvcache_contract.block_hash import token_bytes
from tests.daemons import start_blockd

pytestmark = pytest.mark.skipif(valkey_server_binary() is None, reason="no valkey-server binary")

BLOCK = 4
NAMESPACE = pb.Namespace(model_id="m", model_revision="r", dtype="float32")
TOKENS = list(range(700, 700 + 5 * BLOCK))


def _keys(client: valkey.Valkey) -> set[bytes]:
    return set(client.scan_iter(match="kvcache:*"))


def test_a_write_reported_after_a_flush_has_its_key_deleted(tmp_path) -> None:
    store = start_valkey(tmp_path / "valkey")
    url = f"redis://{store.address}"
    blockd = start_blockd(tmp_path / "blockd", "--shared-tier", url)
    client = valkey.Valkey.from_url(url)
    try:
        with grpc.insecure_channel(blockd.address) as channel:
            worker = pb_grpc.BlockDirectoryServiceStub(channel)
            admin = pb_grpc.DirectoryAdminServiceStub(channel)
            pool = worker.RegisterPool(
                pb.RegisterPoolRequest(
                    num_blocks=16, block_size=BLOCK, namespace=NAMESPACE, has_shared_tier=True
                ),
                timeout=10,
            )

            def step(**ops) -> pb.StepResponse:
                return worker.Step(pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch, **ops), timeout=10)

            admitted = step(admits=[pb.AdmitOp(sequence_id=1, token_bytes=token_bytes(TOKENS))]).admits[0]
            stores = step(
                commits=[
                    pb.CommitOp(sequence_id=1, block_ids=admitted.block_ids, token_bytes=token_bytes(TOKENS))
                ]
            ).shared_stores
            assert len(stores) == 5  # blockd asks the worker to write the 5 blocks
            admin.Flush(pb.FlushRequest(tier=pb.TIER_SHARED), timeout=10)
            # The worker's writes were under way: they land after the flush deleted the keys.
            keys = {f"kvcache:{pool.shared_namespace}:{s.block_hash.hex()}".encode() for s in stores}
            for key in keys:
                client.set(key, b"a value the flush did not see")
            assert _keys(client) == keys
            step(shared_written=[s.block_hash for s in stores])  # their report comes next
            deadline = time.monotonic() + 10
            while _keys(client) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _keys(client) == set()
            stats = admin.GetStats(pb.GetStatsRequest(), timeout=10).total.shared
            assert stats.num_blocks == 0  # and none of them was confirmed
    finally:
        client.close()
        blockd.stop()
        store.stop()
