"""Shards and the shared tier (docs/sharding.md): a blockd that re-reads the store's index
(--shared-tier-reread-seconds) finds blocks another shard's worker wrote after it started;
one that reads it at start only does not."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from clients.spawn import start_valkey, valkey_server_binary
from computed.shared_store import Layout, SharedStore, StoredBlock, block_key, encode
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc
from kvcache_contract.block_hash import block_hashes, namespace_seed, token_bytes
from kvcache_contract.shared_value import chain_digest
from tests.daemons import start_blockd

pytestmark = pytest.mark.skipif(valkey_server_binary() is None, reason="no valkey-server binary")

BLOCK = 4
NAMESPACE = pb.Namespace(model_id="m", model_revision="r", dtype="float32")
LAYOUT = Layout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BLOCK, dtype="float32", itemsize=4)
TOKENS = list(range(500, 500 + 5 * BLOCK))


def _write_as_another_shards_worker(url: str) -> int:
    """The chain of TOKENS' 5 blocks, in the store's value format, as a worker writes it."""
    seed = namespace_seed("m", "r", "float32", "", BLOCK)
    hashes = block_hashes(seed, token_bytes(TOKENS), BLOCK)
    blocks, chain = [], None
    for i, h in enumerate(hashes):
        tokens = tuple(TOKENS[i * BLOCK : (i + 1) * BLOCK])
        chain = chain_digest(chain, token_bytes(tokens))  # an unsalted block's identity: its tokens
        blocks.append(StoredBlock(i, h, hashes[i - 1] if i else None, tokens, None, i, chain))
    kv = bytes(LAYOUT.kv_nbytes)

    async def write() -> list[bool]:
        store = SharedStore(url)
        try:
            return await store.write(
                [(block_key(seed, b.block_hash), encode(seed, b, LAYOUT, kv)) for b in blocks]
            )
        finally:
            await store.close()

    assert all(asyncio.run(write()))
    return len(blocks)


def _register_reader(address: str) -> None:
    """A pool of the namespace, with the shared tier: its stats count the namespace's blocks."""
    with grpc.insecure_channel(address) as channel:
        pb_grpc.BlockDirectoryServiceStub(channel).RegisterPool(
            pb.RegisterPoolRequest(
                num_blocks=16, block_size=BLOCK, namespace=NAMESPACE, has_shared_tier=True
            ),
            timeout=10,
        )


def _shared_blocks(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stats = pb_grpc.DirectoryAdminServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
    return stats.total.shared.num_blocks


def test_a_shard_that_rereads_the_store_finds_another_shards_blocks(tmp_path) -> None:
    valkey = start_valkey(tmp_path / "valkey")
    url = f"redis://{valkey.address}"
    rereads = start_blockd(
        tmp_path / "a", "--shared-tier", url, "--shared-tier-reread-seconds", "0.2", name="a"
    )
    once = start_blockd(tmp_path / "b", "--shared-tier", url, name="b")
    try:
        time.sleep(0.5)  # both rebuilt their (empty) index at start
        for daemon in (rereads, once):
            _register_reader(daemon.address)
        assert _shared_blocks(rereads.address) == _shared_blocks(once.address) == 0
        written = _write_as_another_shards_worker(url)
        deadline = time.monotonic() + 10
        while (found := _shared_blocks(rereads.address)) < written:
            assert time.monotonic() < deadline, f"{found} of {written} blocks found by re-reading"
            time.sleep(0.1)
        assert found == written
        with grpc.insecure_channel(rereads.address) as channel:
            lookup = pb_grpc.DirectoryAdminServiceStub(channel).Lookup(pb.LookupRequest(token_ids=TOKENS))
        assert [m.num_shared_cached_tokens for m in lookup.matches] == [len(TOKENS)]
        assert _shared_blocks(once.address) == 0  # read at start only
    finally:
        for daemon in (rereads, once, valkey):
            daemon.stop()


def test_the_reread_needs_a_store_and_a_sane_interval(tmp_path) -> None:
    from blockd.__main__ import build_parser, config_from_args

    parser = build_parser()
    for args, error in (
        (["--shared-tier-reread-seconds", "1"], "needs --shared-tier"),
        (["--shared-tier", "redis://127.0.0.1:1", "--shared-tier-reread-seconds", "0"], "0.1 .. 86400"),
    ):
        with pytest.raises(ValueError, match=error):
            config_from_args(parser.parse_args(args))
