"""Who may speak for a worker (issue 16): the worker token on the worker API, pool
tokens on re-registration of a live pool, and the route token on Route."""

from __future__ import annotations

import json
import signal

import grpc
import pytest

from blockd.config import BlockdConfig, DirectoryConfig
from blockd.directory import BlockDirectory
from blockd.types import PermissionDenied, StaleEpoch
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc
from tests.blockd.conftest import AUTH, start_inprocess
from tests.blockd.helpers import NAMESPACE, harness
from tests.blockd.invariants import check_invariants, snapshot
from tests.daemons import start_blockd

A = list(range(100, 112))  # 3 full blocks of 4
WORKER_TOKEN = "w0rker-s3cret"
WORKER = (("authorization", f"Bearer {WORKER_TOKEN}"),)

# ---------------------------------------------------------------- the core


def test_a_strangers_reregistration_of_a_live_pool_is_refused_and_changes_nothing():
    h = harness()
    h.run(1, A)
    before = snapshot(h.directory)
    for token in (None, "guess"):
        with pytest.raises(PermissionDenied, match="pool_token"):
            h.directory.register_pool(16, 4, NAMESPACE, "intruder:1", pool_id=h.pool_id, pool_token=token)
        assert snapshot(h.directory) == before
    assert h.admit(2, A).num_cached_tokens == 12  # the owner's cache and epoch still serve


def test_the_owner_with_its_pool_token_gets_its_pool_back():
    h = harness()
    first = h.directory.register_pool(16, 4, NAMESPACE, "worker-1:1", pool_id="worker-1")
    assert len(first.pool_token) >= 24
    again = h.directory.register_pool(
        16, 4, NAMESPACE, "worker-1:1", pool_id="worker-1", pool_token=first.pool_token
    )
    assert again.epoch == first.epoch + 1 and again.pool_token == first.pool_token
    with pytest.raises(StaleEpoch):
        h.directory.renew_lease("worker-1", first.epoch)
    h.directory.renew_lease("worker-1", again.epoch)
    check_invariants(h.directory)


def test_a_lapsed_pool_may_be_claimed_and_a_restarted_blockd_adopts_the_token():
    h = harness(lease_ttl_seconds=10)
    owner = h.directory.register_pool(16, 4, NAMESPACE, "w", pool_id="worker-2")
    h.clock.advance(11)  # the worker is gone: its pool holds nothing worth protecting
    claimed = h.directory.register_pool(16, 4, NAMESPACE, "w2", pool_id="worker-2")
    assert claimed.pool_token != owner.pool_token
    # blockd restarts: the worker re-registers with its own token, which becomes the pool's
    restarted = BlockDirectory(h.directory.config, clock=h.clock)
    back = restarted.register_pool(16, 4, NAMESPACE, "w", pool_id="worker-2", pool_token=owner.pool_token)
    assert back.pool_token == owner.pool_token
    with pytest.raises(PermissionDenied):
        restarted.register_pool(16, 4, NAMESPACE, "x", pool_id="worker-2", pool_token=claimed.pool_token)


def test_a_pool_is_its_owners_with_every_configuration():
    """No setting lets a stranger reset a live pool (issue 43: the default once did)."""
    assert not any("pool_token" in name for name in DirectoryConfig.__dataclass_fields__)


# ---------------------------------------------------------------- the gRPC services


def _config(**kw) -> BlockdConfig:
    return BlockdConfig(
        listen="127.0.0.1:0",
        admin_token="s3cret-admin",
        shutdown_grace_seconds=0.5,
        directory=DirectoryConfig(max_sequence_tokens=4096, lease_ttl_seconds=30.0),
        **kw,
    )


@pytest.fixture
async def guarded():
    env = await start_inprocess(_config(worker_token=WORKER_TOKEN, route_token="r0ute"))
    yield env
    await env.channel.close()
    await env.server.stop(0)


def _register(pool_id: str = "worker-9", pool_token: str = "") -> pb.RegisterPoolRequest:
    return pb.RegisterPoolRequest(
        num_blocks=64,
        block_size=16,
        namespace=pb.Namespace(model_id="m"),
        worker_address="w:1",
        pool_id=pool_id,
        pool_token=pool_token,
    )


async def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code(), info.value.details()


async def test_worker_calls_need_the_worker_token(guarded):
    workers = guarded.workers
    code, details = await _code(workers.RegisterPool(_register()))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in details and "--worker-token" in details
    for metadata in ((("authorization", "Bearer wrong"),), AUTH):  # the admin token is not a worker token
        code, details = await _code(workers.RegisterPool(_register(), metadata=metadata))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "worker token" in details
    pool = await workers.RegisterPool(_register(), metadata=WORKER)
    for call in (
        workers.RenewLease(pb.RenewLeaseRequest(pool_id=pool.pool_id, epoch=pool.epoch)),
        workers.Step(pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch)),
        workers.Resync(pb.ResyncRequest(pool_id=pool.pool_id, epoch=pool.epoch)),
    ):
        assert (await _code(call))[0] == grpc.StatusCode.UNAUTHENTICATED
    await workers.RenewLease(pb.RenewLeaseRequest(pool_id=pool.pool_id, epoch=pool.epoch), metadata=WORKER)


async def test_a_strangers_takeover_is_refused_and_the_workers_cache_survives(guarded):
    workers, prompt = guarded.workers, list(range(1000, 1040))
    pool = await workers.RegisterPool(_register(), metadata=WORKER)
    assert pool.pool_token

    def step(**ops) -> pb.StepRequest:
        return pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch, **ops)

    admit = pb.AdmitOp(sequence_id=1, token_ids=prompt)
    admitted = (await workers.Step(step(admits=[admit]), metadata=WORKER)).admits[0]
    commit = pb.CommitOp(sequence_id=1, block_ids=admitted.block_ids[:2], token_ids=prompt[:32])
    await workers.Step(step(commits=[commit], releases=[pb.ReleaseOp(sequence_id=1)]), metadata=WORKER)
    for stranger in ("", "not-the-token"):
        code, details = await _code(workers.RegisterPool(_register(pool_token=stranger), metadata=WORKER))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "pool_token" in details
    lookup = await guarded.admin.Lookup(pb.LookupRequest(token_ids=prompt), metadata=AUTH)
    assert lookup.matches[0].num_cached_tokens == 32  # the worker's cache survived
    again = pb.AdmitOp(sequence_id=2, token_ids=prompt)
    reply = await workers.Step(step(admits=[again]), metadata=WORKER)
    assert reply.admits[0].num_cached_tokens == 32  # and its epoch still holds


async def test_a_restarted_worker_with_its_pool_token_gets_its_pool_back(guarded):
    workers = guarded.workers
    pool = await workers.RegisterPool(_register(), metadata=WORKER)
    back = await workers.RegisterPool(_register(pool_token=pool.pool_token), metadata=WORKER)
    assert (
        back.pool_id == pool.pool_id and back.epoch == pool.epoch + 1 and back.pool_token == pool.pool_token
    )
    code, _ = await _code(
        workers.Step(pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch), metadata=WORKER)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION  # the old incarnation is fenced off
    await workers.Resync(pb.ResyncRequest(pool_id=back.pool_id, epoch=back.epoch), metadata=WORKER)


async def test_route_needs_the_route_token_when_one_is_set(guarded):
    request = pb.RouteRequest(token_ids=[1, 2, 3])
    assert (await _code(guarded.routing.Route(request)))[0] == grpc.StatusCode.UNAUTHENTICATED
    code, _ = await _code(guarded.routing.Route(request, metadata=WORKER))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    await guarded.routing.Route(request, metadata=(("authorization", "Bearer r0ute"),))


async def test_open_worker_api_by_default_but_a_live_pool_stays_its_owners():
    env = await start_inprocess(_config())
    try:
        pool = await env.workers.RegisterPool(_register())  # no worker token needed
        for stranger in ("", "not-the-token"):
            code, details = await _code(env.workers.RegisterPool(_register(pool_token=stranger)))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "pool_token" in details
        again = await env.workers.RegisterPool(_register(pool_token=pool.pool_token))
        assert again.epoch == pool.epoch + 1
        await env.routing.Route(pb.RouteRequest(token_ids=[1]))
    finally:
        await env.channel.close()
        await env.server.stop(0)


async def test_computed_directory_client_presents_the_worker_and_pool_tokens(guarded):
    from computed.directory_client import DirectoryClient, PoolSpec
    from computed.errors import DirectoryUnavailable

    spec = PoolSpec(
        num_blocks=64, block_size=16, model_id="m", model_revision="r", dtype="float32", worker_address="w:1"
    )
    client = DirectoryClient(guarded.address, spec, worker_token=WORKER_TOKEN)
    stranger = DirectoryClient(guarded.address, spec, worker_token=WORKER_TOKEN)
    anonymous = DirectoryClient(guarded.address, spec)
    other_worker = DirectoryClient(guarded.address, spec, worker_token=WORKER_TOKEN)
    try:
        first = await client.register()
        again = await client.register()  # recover(): the same pool id, its token presented
        assert (again.pool_id, again.epoch) == (first.pool_id, first.epoch + 1)
        with pytest.raises(DirectoryUnavailable, match="UNAUTHENTICATED"):
            await anonymous.register()
        stranger.lease = type(first)(first.pool_id, first.epoch, first.lease_ttl_seconds)  # no token
        with pytest.raises(DirectoryUnavailable, match="PERMISSION_DENIED"):
            await stranger.register()
        assert (await other_worker.register()).pool_id != first.pool_id
    finally:
        for each in (client, stranger, anonymous, other_worker):
            await each.close()


# ---------------------------------------------------------------- the daemon


def test_daemon_says_when_the_worker_api_is_open_and_takes_the_token_from_the_environment(tmp_path):
    open_daemon = start_blockd(tmp_path / "open", "--log-format", "json")
    try:  # the default mode: a stranger cannot take a live pool and wipe its cache
        with grpc.insecure_channel(open_daemon.address) as channel:
            workers = pb_grpc.BlockDirectoryServiceStub(channel)
            owner = workers.RegisterPool(_register(), timeout=5)
            prompt = list(range(1000, 1040))
            step = pb.StepRequest(pool_id=owner.pool_id, epoch=owner.epoch)
            step.admits.add(sequence_id=1, token_ids=prompt)
            table = workers.Step(step, timeout=5).admits[0].block_ids
            step = pb.StepRequest(pool_id=owner.pool_id, epoch=owner.epoch)
            step.commits.add(sequence_id=1, block_ids=table[:2], token_ids=prompt[:32])
            step.releases.add(sequence_id=1)
            workers.Step(step, timeout=5)
            with pytest.raises(grpc.RpcError) as info:
                workers.RegisterPool(_register(), timeout=5)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "pool_token" in info.value.details()
            admin = pb_grpc.DirectoryAdminServiceStub(channel)
            lookup = admin.Lookup(pb.LookupRequest(token_ids=prompt), timeout=5)
            assert lookup.matches[0].num_cached_tokens == 32  # the owner's cache survived
    finally:
        assert open_daemon.stop(signal.SIGTERM) == 0
    events = [json.loads(line) for line in open_daemon.log().splitlines() if line.startswith("{")]
    opened = [e for e in events if e["event"].startswith("worker API open")]
    assert len(opened) == 1 and opened[0]["level"] == "info"  # loopback: one line, no alarm

    daemon = start_blockd(tmp_path / "closed", "--log-format", "json", env={"BLOCKD_WORKER_TOKEN": "env-tok"})
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            workers = pb_grpc.BlockDirectoryServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                workers.RegisterPool(_register(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            pool = workers.RegisterPool(
                _register(), metadata=(("authorization", "Bearer env-tok"),), timeout=5
            )
            with pytest.raises(grpc.RpcError) as info:
                workers.RegisterPool(_register(), metadata=(("authorization", "Bearer env-tok"),), timeout=5)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # live pool, no pool token
            assert pool.pool_token
    finally:
        assert daemon.stop(signal.SIGTERM) == 0
    assert "worker API open" not in daemon.log()


def test_both_daemons_serve_with_a_worker_token(tmp_path):
    """computed --worker-token registers with a guarded blockd and its cache works."""
    from clients.client import ComputedClient
    from tests.daemons import start_computed

    blockd = start_blockd(tmp_path, "--worker-token", WORKER_TOKEN)
    computed = start_computed(tmp_path, blockd.address, "--worker-token", WORKER_TOKEN, "--num-blocks", "64")
    try:
        with ComputedClient(computed.address) as client:
            prompt = list(range(7, 7 + 40))
            first = client.complete(token_ids=prompt, max_tokens=2)
            second = client.complete(token_ids=prompt, max_tokens=2)
        assert first.usage.cached_tokens == 0 and second.usage.cached_tokens == 32
        assert first.token_ids == second.token_ids
    finally:
        assert computed.stop() == 0, computed.log()
        assert blockd.stop() == 0, blockd.log()
