"""The lower-tier protocol: a new tier is one module plus one registry entry, and an
admission walks the tiers in order (device, host, shared).

`MemoryTier` below stands for such a module (a disk or an object store): it keeps
what the device pool evicts in a dict, answers an admission's walk after the
faster tiers' hits, and says what the worker loads. Registered for one test, it is
walked by the unchanged pool and directory."""

from __future__ import annotations

from typing import ClassVar

import pytest

from blockd.block import Block, Sequence
from blockd.prompt import Prompt
from blockd.tiers import registry
from blockd.tiers.base import NO_WORK, LowerTier, TierSetup, TierWork
from blockd.tiers.host import HostLevel
from blockd.tiers.shared import SharedLevel
from blockd.types import AdmitOp, BlockHash, BlockId, CommitOp, HostSpec, ReleaseOp, Tier
from tests.blockd.helpers import NAMESPACE, harness

BS = 2
A = [1, 2, 3, 4]  # two blocks
B = [5, 6, 7, 8, 9, 10, 11, 12]  # four blocks


class MemoryTier(LowerTier):
    """Evicted blocks kept in a dict by hash: (parent hash, payload, slot)."""

    tier: ClassVar[Tier] = Tier.HOST  # the contract's nearest tier, for flush and events
    admit_field: ClassVar[str] = "loads"
    takes_demotions: ClassVar[bool] = True

    def __init__(self, setup: TierSetup) -> None:
        self.setup = setup
        self.records: dict[BlockHash, tuple[BlockHash | None, bytes, int]] = {}
        self.matched: list[int] = []  # how many faster hits each walk went on from
        self._demotions: list[tuple[BlockId, int]] = []

    def match(self, prompt: Prompt, hits: list) -> list:
        self.matched.append(len(hits))
        payloads = prompt.payloads(self.setup.block_size)[len(hits) :]
        parent = hits[-1].block_hash if hits else None
        found = []
        for block_hash in self.setup.hasher.walk(parent or self.setup.seed, payloads):
            record = self.records.get(block_hash)
            if record is None or record[0] != parent or record[1] != payloads[len(found)]:
                break
            found.append(_Hit(block_hash, record[2]))
            parent = block_hash
        return found

    def loads(self, block_ids: list[BlockId], hits: list, sequence: Sequence) -> tuple:
        return tuple((block_id, hit.slot) for block_id, hit in zip(block_ids, hits))

    def demote(self, dropped: list[Block]) -> None:
        for block in reversed(dropped):  # parent first
            parent = block.parent.block_hash if block.parent is not None else None
            slot = len(self.records)
            self.records[block.block_hash] = (parent, block.payload, slot)
            self._demotions.append((block.block_id, slot))  # type: ignore[arg-type]

    def end_step(self) -> TierWork:
        if not self._demotions:
            return NO_WORK
        demotions, self._demotions = tuple(self._demotions), []
        return TierWork(demotions=demotions)  # type: ignore[arg-type]


class _Hit:
    def __init__(self, block_hash: BlockHash, slot: int) -> None:
        self.block_hash = block_hash
        self.slot = slot


@pytest.fixture
def memory_tier(monkeypatch):
    """The one registry entry: MemoryTier between the host tier and the shared tier."""
    built: list[MemoryTier] = []

    def build(setup: TierSetup) -> MemoryTier:
        built.append(MemoryTier(setup))
        return built[-1]

    monkeypatch.setitem(registry.TIERS, "memory", registry.TierEntry("memory", 1.5, build))
    return built


def test_the_registry_orders_host_before_shared():
    h = harness(num_blocks=4, block_size=BS, host=HostSpec(8, has_shared_tier=True))
    assert [type(t) for t in h.pool.lower_tiers] == [HostLevel, SharedLevel]
    assert harness(num_blocks=4, block_size=BS).pool.lower_tiers == []


def test_a_registered_tier_takes_evictions_and_serves_them_back(memory_tier):
    h = harness(num_blocks=4, block_size=BS)  # no host tier, no shared tier: only the new one
    (tier,) = memory_tier
    assert h.pool.lower_tiers == [tier]
    a_table = h.run(1, A).block_ids
    admitted = h.step(admits=[AdmitOp(2, B)])  # needs all four blocks: A's two are evicted
    assert admitted.admits[0].admitted
    # The step answers the new tier's work as it answers the host tier's: copy before writing.
    assert sorted(admitted.demotions) == [(a_table[0], 0), (a_table[1], 1)]
    assert set(a_table) <= set(admitted.admits[0].block_ids)
    assert h.directory.step(h.pool_id, h.epoch).demotions == ()  # answered once, not left behind
    h.step(releases=[ReleaseOp(2)])

    again = h.step(admits=[AdmitOp(3, A)]).admits[0]
    assert again.admitted and again.num_cached_tokens == len(A)
    assert again.loads == ((again.block_ids[0], 0), (again.block_ids[1], 1))  # parent first
    assert tier.matched[-1] == 0  # the device had none of A
    h.step(commits=[CommitOp(3, again.block_ids, A)])  # loaded, then committed like a load
    assert h.directory.lookup(A, pool_id=h.pool_id)[0].num_cached_tokens == len(A)
    stats = h.directory.stats(h.pool_id).total
    assert stats.hit_tokens == len(A) and stats.num_evictions == 2


def test_an_admission_walks_device_then_host_then_a_new_tier_then_shared(memory_tier):
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # five blocks
    spec = HostSpec(8, has_shared_tier=True)
    h = harness(num_blocks=8, block_size=BS, host=spec)
    other = h.directory.register_pool(8, BS, NAMESPACE, "worker-1:50052", host=HostSpec(has_shared_tier=True))
    # The other worker computes the whole prompt and writes it to the shared tier.
    table = h.directory.step(other.pool_id, other.epoch, admits=[AdmitOp(1, prompt)]).admits[0].block_ids
    stores = h.directory.step(
        other.pool_id, other.epoch, commits=[CommitOp(1, table[:5], prompt)]
    ).shared_stores
    h.directory.step(other.pool_id, other.epoch, shared_written=[s.block_hash for s in stores])
    # This worker holds the first three blocks; a one-off prompt then evicts the third to its host tier.
    held = h.admit(1, prompt[:6])  # fetched from the shared tier, then committed
    h.step(commits=[CommitOp(1, held.block_ids, prompt[:6])], releases=[ReleaseOp(1)])
    evicting = h.step(admits=[AdmitOp(2, list(range(20, 32)))])  # six blocks: 5 free + 1 evicted
    assert len(evicting.demotions) == 1
    h.step(releases=[ReleaseOp(2)])
    host, memory, shared = h.pool.lower_tiers
    assert (type(host), type(shared)) == (HostLevel, SharedLevel) and memory is memory_tier[0]
    walked: list[tuple[str, int]] = []
    for name, tier in (("host", host), ("memory", memory), ("shared", shared)):
        tier.match = _recording(name, tier.match, walked)  # type: ignore[method-assign]

    before = h.directory.stats(h.pool_id).total
    result = h.step(admits=[AdmitOp(3, prompt)]).admits[0]
    assert walked == [("host", 2), ("memory", 3), ("shared", 3)]  # each after the faster tiers' hits
    assert result.num_cached_tokens == len(prompt)
    assert [b for b, _ in result.loads] == [result.block_ids[2]]  # the host hit, after two device hits
    assert [s.block_id for s in result.shared_loads] == list(result.block_ids[3:])
    after = h.directory.stats(h.pool_id).total
    assert after.host.hit_tokens - before.host.hit_tokens == BS
    assert after.shared.hit_tokens - before.shared.hit_tokens == 2 * BS


def _recording(name, match, walked):
    def recorded(prompt, hits):
        walked.append((name, len(hits)))
        return match(prompt, hits)

    return recorded


def test_tier_work_adds_field_by_field():
    a = TierWork(demotions=((1, 2),))
    b = TierWork(demotions=((3, 4),), shared_stores=())
    assert (a + b).demotions == ((1, 2), (3, 4)) and (a + NO_WORK) == a
