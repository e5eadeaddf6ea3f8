"""KV events (WatchEvents) against the live stack.

A subscriber that rebuilds blockd's index from events alone (STORED adds blocks,
REMOVED deletes them, CLEARED drops a pool) must agree with ListBlocks, read page by
page, after a random workload on two small pools (evictions), salted requests, a
salt flush, a pool flush and a pool reset. Sequence numbers must run without
duplicates or holes, a resume from a recent number must get exactly the events
after it, and a resume from outside the replay window must get a GAP event, never
a silent skip.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from blockd.config import DirectoryConfig
from clients.client import BlockdClient, KVCacheClient
from kvcache.v1 import directory_pb2 as pb
from kvcache.v1 import directory_pb2_grpc as pb_grpc
from tests.daemons import REPO, start_blockd
from tests.scaleout.fakepool import FakePool
from tests.scaleout.helpers import BLOCK_SIZE, Stack, random_tokens

SEED = 7
SALT = "tenant-x"
KINDS = {
    pb.BLOCK_EVENT_KIND_STORED: "stored",
    pb.BLOCK_EVENT_KIND_REMOVED: "removed",
    pb.BLOCK_EVENT_KIND_CLEARED: "cleared",
    pb.BLOCK_EVENT_KIND_GAP: "gap",
}
NAMESPACE = pb.Namespace(model_id="fake-model", model_revision="r1", dtype="float32")

Index = dict[str, dict[bytes, tuple[int, bytes, tuple[int, ...]]]]  # pool -> hash -> (id, parent, tokens)


class Mirror:
    """blockd's index rebuilt from a WatchEvents stream read in a background thread.

    Starts empty at `after_sequence` (the caller makes sure the index was empty then).
    Records every contract violation it sees instead of raising in its thread: a hole
    or duplicate in the sequence numbers, a GAP, a STORED block already present or
    whose parent is not findable, a REMOVED block it never saw, a block left without
    its parent.
    """

    def __init__(self, channel: grpc.Channel, after_sequence: int) -> None:
        self.index: Index = defaultdict(dict)
        self.events: dict[int, pb.WatchEventsResponse] = {}
        self.errors: list[str] = []
        self.last_sequence = after_sequence
        self._changed = threading.Condition()
        request = pb.WatchEventsRequest(after_sequence=after_sequence)
        self._call = pb_grpc.DirectoryAdminServiceStub(channel).WatchEvents(request)
        self._thread = threading.Thread(target=self._read, name="event-mirror", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self._call:
                with self._changed:
                    self._apply(event)
                    self._changed.notify_all()
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                with self._changed:
                    self.errors.append(f"stream failed: {error.code()} {error.details()}")

    def _apply(self, event: pb.WatchEventsResponse) -> None:
        if event.sequence != self.last_sequence + 1:
            self.errors.append(f"event {event.sequence} follows {self.last_sequence}")
        self.last_sequence = event.sequence
        self.events[event.sequence] = event
        pool = self.index[event.pool_id]
        if event.kind == pb.BLOCK_EVENT_KIND_STORED:
            if len(event.token_ids) != BLOCK_SIZE * len(event.block_hashes) or len(event.block_ids) != len(
                event.block_hashes
            ):
                self.errors.append(f"malformed STORED {event.sequence}")
            parent = event.parent_hash
            if parent and parent not in pool:
                self.errors.append(f"STORED {event.sequence}: parent not findable")
            for i, (block_hash, block_id) in enumerate(
                zip(event.block_hashes, event.block_ids, strict=False)
            ):
                if block_hash in pool:
                    self.errors.append(f"STORED {event.sequence}: block already stored")
                tokens = tuple(event.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
                pool[block_hash] = (block_id, parent, tokens)
                parent = block_hash
        elif event.kind == pb.BLOCK_EVENT_KIND_REMOVED:
            for block_hash in event.block_hashes:
                if pool.pop(block_hash, None) is None:
                    self.errors.append(f"REMOVED {event.sequence}: block never stored")
            orphans = [h for h, (_, parent, _) in pool.items() if parent and parent not in pool]
            if orphans:
                self.errors.append(f"REMOVED {event.sequence} left {len(orphans)} blocks without parent")
        elif event.kind == pb.BLOCK_EVENT_KIND_CLEARED:
            pool.clear()
        else:
            self.errors.append(f"unexpected {KINDS.get(event.kind, event.kind)} event {event.sequence}")

    def wait_for(self, sequence: int, timeout: float = 10.0) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.last_sequence >= sequence, timeout), (
                f"the mirror saw events up to {self.last_sequence}, blockd is at {sequence}"
            )

    def snapshot(self) -> Index:
        with self._changed:
            return {pool: dict(blocks) for pool, blocks in self.index.items() if blocks}

    def kinds(self) -> Counter:
        with self._changed:
            return Counter(KINDS[e.kind] for e in self.events.values())

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(10)


def listed_index(client: BlockdClient) -> Index:
    """ListBlocks, every page (small pages, so paging is exercised)."""
    index: Index = defaultdict(dict)
    for block in client.iter_blocks(page_size=7):
        index[block.pool_id][block.block_hash] = (block.block_id, block.parent_hash or b"", block.token_ids)
    return dict(index)


def settled(stack: Stack, client: BlockdClient, mirror: Mirror) -> tuple[Index, Index, int]:
    """(mirror, listing, sequence) read while nothing changes between them."""
    stack.wait_idle()
    for _ in range(20):
        last = client.get_stats().last_event_sequence
        mirror.wait_for(last)
        mirrored, listed = mirror.snapshot(), listed_index(client)
        if client.get_stats().last_event_sequence == last:
            return mirrored, listed, last
    raise AssertionError("blockd's events never settled")


def workload(stack: Stack, rng: random.Random, num_requests: int) -> None:
    """Random prompts, some sharing prefixes of three trunks, some salted, two at a time
    over both workers (round robin): far more blocks than two 9-block pools hold."""
    trunks = [random_tokens(rng, 5 * BLOCK_SIZE) for _ in range(3)]
    requests = []
    for _ in range(num_requests):
        head = rng.choice(trunks)[: rng.randrange(5) * BLOCK_SIZE + rng.randrange(BLOCK_SIZE)]
        requests.append(
            (
                head + random_tokens(rng, rng.randrange(1, 17)),
                SALT if rng.random() < 0.3 else "",
                rng.randrange(1, 4),
            )
        )
    with KVCacheClient(stack.blockd.address, stack.worker_addresses, routing="round-robin") as client:

        def send(request: tuple[list[int], str, int]) -> None:
            tokens, salt, max_tokens = request
            client.complete(token_ids=tokens, cache_salt=salt, max_tokens=max_tokens)

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(send, requests))


def test_event_mirror_agrees_with_list_blocks(stack: Stack) -> None:
    rng = random.Random(SEED)
    stack.wait_idle()
    with stack.client() as client, grpc.insecure_channel(stack.blockd.address) as channel:
        client.flush()
        start = client.get_stats()
        assert listed_index(client) == {}, "a flush of idle pools leaves nothing cached"
        assert client.get_stats().last_event_sequence == start.last_event_sequence
        mirror = Mirror(channel, start.last_event_sequence)
        try:
            workload(stack, rng, 24)
            mirrored, listed, _ = settled(stack, client, mirror)
            evictions = client.get_stats().total.num_evictions - start.total.num_evictions
            assert evictions > 0 and mirror.kinds()["removed"] > 0, "the workload must evict"
            assert listed and mirrored == listed
            assert not mirror.errors, mirror.errors

            print(
                f"\nmirror after the workload: {dict(mirror.kinds())}, "
                f"{sum(map(len, listed.values()))} blocks agree"
            )

            salted = random_tokens(rng, 2 * BLOCK_SIZE + 3)
            with KVCacheClient(stack.blockd.address, stack.worker_addresses) as generator:
                generator.complete(token_ids=salted, cache_salt=SALT, max_tokens=1)
            stack.wait_idle()
            assert client.flush(cache_salt=SALT).dropped >= 2
            client.flush(pool_id=stack.pool_id(stack.worker_a))
            fake = FakePool(channel, NAMESPACE, 16, BLOCK_SIZE, "fake-events.invalid:1")
            fake.cache(1, random_tokens(rng, 3 * BLOCK_SIZE), 3)
            fake.reregister()  # CLEARED
            fake.cache(2, random_tokens(rng, 2 * BLOCK_SIZE + 1), 2)
            workload(stack, rng, 8)
            mirrored, listed, last = settled(stack, client, mirror)
            assert mirrored == listed
            assert len(listed[fake.pool_id]) == 2 and mirror.kinds()["cleared"] >= 1
            assert not mirror.errors, mirror.errors
            print(f"mirror at the end: {dict(mirror.kinds())}, {sum(map(len, listed.values()))} blocks agree")
            assert sorted(mirror.events) == list(range(start.last_event_sequence + 1, last + 1))

            # A subscriber resuming from a recent sequence number: exactly the events after it.
            resume = max(start.last_event_sequence, last - 30)
            replayed = []
            for event in client.watch_events(resume, timeout=10):
                replayed.append(event)
                if event.sequence >= last:
                    break
            assert [e.sequence for e in replayed] == list(range(resume + 1, last + 1))
            for event in replayed:
                original = mirror.events[event.sequence]
                assert (
                    event.kind,
                    event.pool_id,
                    event.block_hashes,
                    event.parent_hash,
                    event.block_ids,
                    event.token_ids,
                ) == (
                    KINDS[original.kind],
                    original.pool_id,
                    tuple(original.block_hashes),
                    original.parent_hash or None,
                    tuple(original.block_ids),
                    tuple(original.token_ids),
                )
        finally:
            mirror.close()


def flood(pool: FakePool, admin: pb_grpc.DirectoryAdminServiceStub, num_events: int) -> int:
    """At least `num_events` events, fast: batches of one-block sequences committed
    (a STORED each); once the pool is full every admission evicts (a REMOVED each).
    Answers the newest sequence number."""
    batch, done, next_id = 1024, 0, 1
    while done < num_events:
        ids = range(next_id, next_id + batch)
        next_id += batch
        reply = pool.step(admits=[pb.AdmitOp(sequence_id=i, token_ids=[i] * BLOCK_SIZE) for i in ids])
        assert all(a.admitted for a in reply.admits)
        pool.step(
            commits=[
                pb.CommitOp(sequence_id=i, block_ids=a.block_ids, token_ids=[i] * BLOCK_SIZE)
                for i, a in zip(ids, reply.admits, strict=True)
            ],
            releases=[pb.ReleaseOp(sequence_id=i) for i in ids],
        )
        done = admin.GetStats(pb.GetStatsRequest(), timeout=10).last_event_sequence
    return done


def first_event(stub: pb_grpc.DirectoryAdminServiceStub, after_sequence: int) -> pb.WatchEventsResponse:
    call = stub.WatchEvents(pb.WatchEventsRequest(after_sequence=after_sequence), timeout=10)
    try:
        return next(call)
    finally:
        call.cancel()


def test_resume_outside_the_replay_window_gets_a_gap(tmp_path: Path) -> None:
    capacity = DirectoryConfig().event_log_capacity  # blockd's default window
    blockd = start_blockd(tmp_path, "--log-format", "json")
    try:
        with grpc.insecure_channel(blockd.address) as channel:
            admin = pb_grpc.DirectoryAdminServiceStub(channel)
            pool = FakePool(channel, NAMESPACE, 4096, BLOCK_SIZE, "fake-gap.invalid:1")
            started = time.monotonic()
            last = flood(pool, admin, capacity + 200)
            print(f"\n{last} events in {time.monotonic() - started:.1f}s")
            oldest = last - capacity + 1
            assert oldest > 2

            for stale in (1, oldest - 2, last + 1000):  # too old, just too old, never reached
                gap = first_event(admin, stale)
                assert (gap.kind, gap.sequence, gap.pool_id) == (pb.BLOCK_EVENT_KIND_GAP, last, ""), stale
            assert first_event(admin, oldest - 1).sequence == oldest  # the oldest retained: no gap

            # After a GAP the stream goes on live from the GAP's number, as the contract says.
            call = admin.WatchEvents(pb.WatchEventsRequest(after_sequence=1), timeout=10)
            try:
                assert next(call).kind == pb.BLOCK_EVENT_KIND_GAP
                pool.cache(10**6, [7] * BLOCK_SIZE * 2, 2)  # the pool is full: evicts, then stores
                live = [next(call), next(call)]
                assert [(e.kind, e.sequence) for e in live] == [
                    (pb.BLOCK_EVENT_KIND_REMOVED, last + 1),
                    (pb.BLOCK_EVENT_KIND_STORED, last + 2),
                ]
            finally:
                call.cancel()
    finally:
        blockd.stop()


def test_event_log_window_is_configurable(tmp_path: Path) -> None:
    """Operators size the replay window (how long a subscriber may be away); blockd's
    core has the setting (DirectoryConfig.event_log_capacity) but the daemon must
    expose it as a flag."""
    usage = subprocess.run(
        [sys.executable, "-m", "blockd", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "--event-log-capacity" in usage, "blockd has no --event-log-capacity flag"
    blockd = start_blockd(tmp_path, "--event-log-capacity", "8", "--log-format", "json")
    try:
        with grpc.insecure_channel(blockd.address) as channel:
            admin = pb_grpc.DirectoryAdminServiceStub(channel)
            pool = FakePool(channel, NAMESPACE, 64, BLOCK_SIZE, "fake-window.invalid:1")
            for i in range(1, 13):
                pool.cache(i, [i] * BLOCK_SIZE, 1)
            last = admin.GetStats(pb.GetStatsRequest(), timeout=10).last_event_sequence
            assert last == 12
            assert first_event(admin, last - 9).kind == pb.BLOCK_EVENT_KIND_GAP
            assert first_event(admin, last - 8).sequence == last - 7
    finally:
        blockd.stop()
