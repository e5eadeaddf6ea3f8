"""The cheap wire forms of a Step (issue 43): a prompt as packed uint32 LE bytes
(`token_bytes`) instead of varints, and a commit by block index that sends no tokens
because blockd holds them from the admission."""

from __future__ import annotations

import grpc
import pytest

from blockd.hashing import token_bytes
from blockd.types import AdmitOp, CommitOp, InvalidArgument, ReleaseOp
from kvcache.v1 import directory_pb2 as pb
from tests.blockd.helpers import harness
from tests.blockd.invariants import snapshot

A = list(range(100, 112))  # 3 full blocks of 4
B = A + [7, 8, 9, 10, 11]  # 4 full blocks and a tail


def test_a_packed_prompt_admits_exactly_as_its_token_list():
    listed, packed = harness(), harness()
    for h, op in ((listed, AdmitOp(1, A)), (packed, AdmitOp(1, (), token_bytes=token_bytes(A)))):
        table = h.step(admits=[op]).admits[0].block_ids
        h.step(commits=[CommitOp(1, table, A)], releases=[ReleaseOp(1)])
    assert list(listed.pool.index) == list(packed.pool.index)  # the same hashes
    for h, op in ((listed, AdmitOp(2, B)), (packed, AdmitOp(2, (), token_bytes=token_bytes(B)))):
        result = h.step(admits=[op]).admits[0]
        assert result.admitted and result.num_cached_tokens == 12


def test_commit_by_block_index_uses_the_admitted_prompt():
    h = harness()
    table = h.admit(1, B).block_ids
    h.step(commits=[CommitOp(1, table[:2])])  # no tokens: blocks 0 and 1 of the prompt
    h.step(commits=[CommitOp(1, table[2:4], token_bytes=token_bytes(B[8:16]))])  # packed, in the prompt
    h.release(1)
    assert h.admit(2, B).num_cached_tokens == 16


def test_commit_by_index_past_the_known_tokens_is_refused_and_changes_nothing():
    h = harness()
    table = h.admit(1, A + [1]).block_ids  # 3 full blocks + 1 token: blockd holds 13 tokens
    before = snapshot(h.directory)
    with pytest.raises(InvalidArgument, match="send the token_ids of blocks past it"):
        h.directory.step(h.pool_id, h.epoch, commits=[CommitOp(1, table[:4])])
    assert snapshot(h.directory) == before
    h.step(commits=[CommitOp(1, table[:3])])  # the full prompt blocks are fine


@pytest.mark.parametrize(
    "op, message",
    [
        (AdmitOp(1, A, token_bytes=token_bytes(A)), "not both"),
        (AdmitOp(1, (), token_bytes=b"\x01\x02\x03"), "multiple of 4"),
        (AdmitOp(1, (), token_bytes=b""), "empty"),
    ],
)
def test_bad_packed_prompts_are_refused(op, message):
    h = harness()
    before = snapshot(h.directory)
    with pytest.raises(InvalidArgument, match=message):
        h.directory.step(h.pool_id, h.epoch, admits=[op])
    assert snapshot(h.directory) == before


async def test_the_packed_fields_over_grpc(blockd):
    reg = await blockd.workers.RegisterPool(
        pb.RegisterPoolRequest(num_blocks=16, block_size=4, namespace=pb.Namespace(model_id="m"))
    )

    def step(**ops) -> pb.StepRequest:
        return pb.StepRequest(pool_id=reg.pool_id, epoch=reg.epoch, **ops)

    packed = token_bytes(B)
    admitted = (
        await blockd.workers.Step(step(admits=[pb.AdmitOp(sequence_id=1, token_bytes=packed)]))
    ).admits[0]
    assert admitted.admitted and len(admitted.block_ids) == 5
    commit = pb.CommitOp(sequence_id=1, block_ids=admitted.block_ids[:4])  # by index: no tokens
    await blockd.workers.Step(step(commits=[commit], releases=[pb.ReleaseOp(sequence_id=1)]))
    again = (await blockd.workers.Step(step(admits=[pb.AdmitOp(sequence_id=2, token_ids=B)]))).admits[0]
    assert again.num_cached_tokens == 16  # the varint prompt hits what the packed one cached
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await blockd.workers.Step(step(admits=[pb.AdmitOp(sequence_id=3, token_bytes=b"\x00" * 5)]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "multiple of 4" in info.value.details()


async def test_the_worker_client_sends_packed_prompts_and_commits_by_index(blockd):
    """computed's DirectoryClient against a real blockd: the prompt goes packed, the
    commit of its blocks goes without tokens, a decoded block goes with them."""
    from computed.directory_client import DirectoryClient, PoolSpec
    from computed.directory_ops import AdmitOp as WAdmit
    from computed.directory_ops import CommitOp as WCommit
    from computed.directory_ops import DirectoryOps
    from computed.directory_ops import GrowOp as WGrow

    spec = PoolSpec(
        num_blocks=16, block_size=4, model_id="m", model_revision="", dtype="", worker_address="w:1"
    )
    client = DirectoryClient(blockd.address, spec, compact_steps=True)
    try:
        await client.register()
        reply = await client.step(DirectoryOps(admits=[WAdmit(1, B[:12], "", 0)]))
        table = reply.admits[0].block_ids
        op = client._commit_op(1, table[:2], B[:8])
        assert not op.token_ids and not op.token_bytes  # by index: blockd holds the prompt
        await client.step(DirectoryOps(commits=[WCommit(1, table[:2], B[:8])]))
        grown = await client.step(DirectoryOps(grows=[WGrow(1, 16, False)]))
        table += grown.grows[0].new_block_ids
        op = client._commit_op(1, table[2:4], B[8:16])
        assert op.token_bytes == token_bytes(B[8:16])  # block 3 was decoded: its tokens go along
        await client.step(DirectoryOps(commits=[WCommit(1, table[2:4], B[8:16])], releases=[1]))
        again = await client.step(DirectoryOps(admits=[WAdmit(2, B, "", 0)]))
        assert again.admits[0].num_cached_tokens == 16
    finally:
        await client.close()


async def test_the_worker_client_places_a_commit_after_the_admitted_hits(blockd):
    """A sequence admitted with cached blocks commits from past them: the client finds
    the run's place in the table (not by counting its own commits), so a block past the
    prompt goes with its tokens and blockd accepts it (a regression: counting from 0
    sent it without tokens, blockd refused, and the worker resynced)."""
    from computed.directory_client import DirectoryClient, PoolSpec
    from computed.directory_ops import AdmitOp as WAdmit
    from computed.directory_ops import CommitOp as WCommit
    from computed.directory_ops import DirectoryOps
    from computed.directory_ops import GrowOp as WGrow

    spec = PoolSpec(
        num_blocks=16, block_size=4, model_id="m", model_revision="", dtype="", worker_address="w:1"
    )
    client = DirectoryClient(blockd.address, spec, compact_steps=True)
    try:
        await client.register()
        table = (await client.step(DirectoryOps(admits=[WAdmit(1, B[:12], "", 0)]))).admits[0].block_ids
        await client.step(DirectoryOps(commits=[WCommit(1, table, B[:12])], releases=[1]))
        admitted = (await client.step(DirectoryOps(admits=[WAdmit(2, B[:14], "", 0)]))).admits[0]
        assert admitted.num_cached_tokens == 12
        table = (
            admitted.block_ids
            + (await client.step(DirectoryOps(grows=[WGrow(2, 16, False)]))).grows[0].new_block_ids
        )
        assert client._commit_op(2, table[3:4], B[12:16]).token_bytes == token_bytes(B[12:16])
        await client.step(DirectoryOps(commits=[WCommit(2, table[3:4], B[12:16])], releases=[2]))
        assert not client.needs_recovery
        again = await client.step(DirectoryOps(admits=[WAdmit(3, B[:16], "", 0)]))
        assert again.admits[0].num_cached_tokens == 16  # the block committed with its tokens hits
    finally:
        await client.close()
