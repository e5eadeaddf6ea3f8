"""The host tier end to end: real blockd, real computed with --host-kv-memory, over gRPC.

A prefix pushed out of a tiny device pool is demoted to the host tier and comes back
from it with the same greedy tokens as transformers; a worker killed with its host
tier full leaks nothing in either tier; Flush empties both; bad sizes are refused
with a message that says what to give.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvcache.v1 import directory_pb2
from tests.computed.test_generation import BLOCK, Stack, _metric, _stack, hf_greedy, prompt
from tests.daemons import start_blockd, start_computed

NUM_BLOCKS = 16  # a 4-block prompt plus its decode fit; a second prompt evicts the first


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    s = _stack(
        tmp_path_factory,
        "llama",
        "--num-blocks",
        str(NUM_BLOCKS),
        "--host-kv-memory",
        "1000000",
        "--metrics-port",
        "0",
    )
    yield s
    assert s.computed.stop() == 0, s.computed.log()
    assert s.blockd.stop() == 0, s.blockd.log()


def _evict_with_others(stack: Stack, seed: int) -> None:
    for i in range(2):  # each fills the device pool: whatever was cached is demoted
        stack.generate(prompt(seed + i, (NUM_BLOCKS - 2) * BLOCK), 4)


def test_an_evicted_prefix_comes_back_from_the_host_tier(tiered: Stack):
    p = prompt(40, 4 * BLOCK + 2)
    cold, u1 = tiered.generate(p, 10)
    _evict_with_others(tiered, 41)
    match = tiered.admin.Lookup(directory_pb2.LookupRequest(token_ids=p), timeout=10).matches[0]
    assert match.num_host_cached_tokens == 4 * BLOCK, "the prefix was not demoted"
    warm, u2 = tiered.generate(p, 10)
    assert warm == cold == hf_greedy(tiered.model_dir, p, 10)
    assert (u1.cached_tokens, u2.cached_tokens, u2.host_cached_tokens) == (0, 4 * BLOCK, 4 * BLOCK)
    host = tiered.wait_idle().host
    assert host.tier == directory_pb2.TIER_HOST and host.num_loads >= 4 and host.num_demotions >= 4
    assert host.num_referenced_blocks == 0
    assert host.load_seconds_per_block > 0 and host.recompute_seconds_per_block > host.load_seconds_per_block
    copied = _metric(tiered, "computed_host_tier_bytes_copied_total")
    num_copies = host.num_loads + host.num_demotions  # one pool: the worker ran exactly these
    assert copied > 0 and copied % num_copies == 0, f"{copied} bytes for {num_copies} block copies"


def test_flush_empties_both_tiers(tiered: Stack):
    tiered.generate(prompt(50, 4 * BLOCK), 4)
    _evict_with_others(tiered, 51)
    tiered.wait_idle()
    reply = tiered.admin.Flush(directory_pb2.FlushRequest(), timeout=10)
    tiers = {row.tier: (row.dropped, row.busy) for row in reply.tiers}
    assert set(tiers) == {directory_pb2.TIER_DEVICE, directory_pb2.TIER_HOST}
    assert tiers[directory_pb2.TIER_HOST][0] > 0 and reply.busy == 0
    stats = tiered.stats()
    assert stats.num_cached_blocks == 0
    assert stats.host.num_free_blocks == stats.host.num_blocks


def test_a_killed_worker_leaks_nothing_in_either_tier(tmp_path, tiered: Stack):
    blockd = start_blockd(tmp_path, "--lease-ttl", "2")
    computed = start_computed(
        tmp_path,
        blockd.address,
        "--block-size",
        str(BLOCK),
        "--num-blocks",
        str(NUM_BLOCKS),
        "--host-kv-memory",
        "1000000",
        model=tiered.model_dir,
    )
    s = Stack(blockd, computed, tiered.model_dir)
    try:
        s.generate(prompt(60, 4 * BLOCK), 4)
        _evict_with_others(s, 61)
        assert s.stats().host.num_free_blocks < s.stats().host.num_blocks
        s.computed.kill()  # kill -9: no release, no goodbye; the lease must lapse
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pools = s.admin.ListPools(directory_pb2.ListPoolsRequest(), timeout=10).pools
            if pools and not pools[0].is_live:
                break
            time.sleep(0.2)
        stats = s.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.num_cached_blocks == 0
        assert stats.host.num_free_blocks == stats.host.num_blocks
    finally:
        assert s.blockd.stop() == 0, s.blockd.log()


def test_a_negative_host_tier_size_is_refused():
    done = subprocess.run(
        [sys.executable, "-m", "computed", "--host-kv-memory", "-1"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--host-kv-memory must be >= 0 bytes (0 disables the host tier), got -1" in done.stderr


def test_a_host_tier_smaller_than_one_block_is_refused(tmp_path, tiered: Stack):
    with pytest.raises(RuntimeError) as failed:
        start_computed(
            tmp_path,
            tiered.blockd.address,
            "--host-kv-memory",
            "10",
            "--block-size",
            str(BLOCK),
            model=tiered.model_dir,
        )
    assert "--host-kv-memory 10 is less than one KV block" in str(failed.value)
