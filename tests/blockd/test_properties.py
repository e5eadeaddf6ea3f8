"""Property tests: random programs of worker and operator calls against the directory,
with every DESIGN.md invariant checked after every operation.

A simulated worker keeps its own model: the sequences it runs, their block tables,
and what it wrote into each physical block (`kv[block] = (prefix tokens, salt)`: the
K/V of a block depends on every token up to its end and, for isolation, on the
salt). Every hit blockd answers must point at a block whose written content is
exactly the one needed; every block handed out must be held by nobody else.

Three hashers: the real xxh3-128; one with sixteen possible values; one blind to
the parent hash and the salt. With the last two collisions happen all the time and only exact
verification (parent block, tokens, salt) keeps the answers right.
"""

from __future__ import annotations

import pytest
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blockd.config import DirectoryConfig
from blockd.directory import BlockDirectory
from blockd.hashing import BlockHasher
from blockd.shared_tier import SharedRecord
from blockd.types import (
    AdmitOp,
    CachePolicy,
    CommitOp,
    DirectoryError,
    GrowOp,
    HostSpec,
    ReleaseOp,
    ResourceExhausted,
    ResyncSequence,
    Tier,
)
from blockd.validation import make_prompt
from tests.blockd.helpers import NAMESPACE, patches_blockd
from tests.blockd.invariants import FakeClock, attributes, check_invariants, holders_of, snapshot

BLOCK_SIZE = 2
NUM_BLOCKS = 12
MAX_TOKENS = 16
LEASE_TTL = 10.0

# Prompts share prefixes often: a prefix of one of a few base prompts, plus a short
# random suffix, over a tiny alphabet (and sometimes just random tokens).
BASES = ([0, 1, 2, 0, 1, 2, 0, 1, 2, 0], [0, 1, 1, 0, 2, 2, 1, 1, 0, 0], [2, 2, 2, 2, 2, 2, 2, 2])
_tokens = st.lists(st.integers(0, 2), max_size=3)
prompts = st.one_of(
    st.tuples(st.sampled_from(BASES), st.integers(1, 10), _tokens).map(lambda t: t[0][: t[1]] + t[2]),
    st.lists(st.integers(0, 2), min_size=1, max_size=10),
)
salts = st.sampled_from(["", "", "a", "b"])
cache_policies = st.sampled_from([CachePolicy.STORE] * 4 + [CachePolicy.READ_ONLY, CachePolicy.NONE])
retentions = st.sampled_from([0, 0, 0, 1, 35, 100])
publics = st.sampled_from([0, 0, 2, 3])


def kv_key(tokens: list[int], index: int, salt: str, public: int) -> tuple:
    """What block `index` of a sequence must contain."""
    end = (index + 1) * BLOCK_SIZE
    salted = salt if salt and index >= public // BLOCK_SIZE else ""
    return tuple(tokens[:end]), salted


class WorkerSequence:
    def __init__(self, tokens: list[int], salt: str, public: int, table: list[int], num_cached: int):
        self.tokens = tokens
        self.salt = salt
        self.public = public
        self.table = table
        self.num_committed = num_cached // BLOCK_SIZE


class DirectoryMachine(RuleBasedStateMachine):
    hasher = BlockHasher()
    host_spec = HostSpec()  # no host tier
    demote_min_hits = 0

    policy = DirectoryConfig().eviction_policy  # the default

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.config = DirectoryConfig(
            max_sequence_tokens=MAX_TOKENS,
            lease_ttl_seconds=LEASE_TTL,
            event_log_capacity=64,
            demote_min_hits=self.demote_min_hits,
            eviction_policy=self.policy,
            ghosts_per_block=0.5,  # a small ghost table: it fills and forgets
        )
        self.directory = BlockDirectory(self.config, clock=self.clock, hasher=self.hasher)
        reg = self.directory.register_pool(NUM_BLOCKS, BLOCK_SIZE, NAMESPACE, "worker:1", host=self.host_spec)
        self.pool_id, self.epoch, self.pool_token = reg.pool_id, reg.epoch, reg.pool_token
        self.live: dict[int, WorkerSequence] = {}
        self.kv: dict[int, tuple] = {}  # physical block -> what the worker wrote into it
        self.host_kv: dict[int, tuple] = {}  # host tier block -> what the worker copied there
        # The shared tier's store as workers see it: key (block hash) -> (header, content);
        # writes snapshotted but not landed yet; reports not yet sent to blockd.
        self.store: dict[bytes, tuple] = {}
        self.writing: dict[bytes, tuple] = {}
        self.missing: list[bytes] = []
        self.pins: list[str] = []  # in creation order: pin ids are random, draws must not be
        self.next_id = 1
        self.history: list[tuple[list[int], str, int]] = []
        self.num_steps = 0  # since the last reset: resets wait a while, so state can build up

    # ------------------------------------------------------------ helpers

    def step(self, **ops):
        self.num_steps += 1
        result = self.directory.step(self.pool_id, self.epoch, **ops)
        for block_id, host_block_id in result.demotions:  # the worker copies before any write
            self.host_kv[host_block_id] = self.kv.get(block_id)
        for store in result.shared_stores:  # ... and snapshots what it must store, before any write
            self.writing[store.block_hash] = (_header(store), self.kv.get(store.block_id))
        return result

    def held_by_others(self, sequence_id: int | None) -> set[int]:
        held = {b for sid, seq in self.live.items() if sid != sequence_id for b in seq.table}
        holders, _ = holders_of(self.directory, self.pool_id)
        pinned = {b for b, n in holders.items() if n > sum(b in s.table for s in self.live.values())}
        return held | pinned

    def commit_next(self, sequence_id: int, count: int) -> None:
        """The worker's forward step wrote `count` more full blocks: commit them."""
        seq = self.live[sequence_id]
        start = seq.num_committed
        block_ids = seq.table[start : start + count]
        others = self.held_by_others(sequence_id)
        for i, block_id in enumerate(block_ids, start):
            assert block_id not in others, "writing into a shared block"
            self.kv[block_id] = kv_key(seq.tokens, i, seq.salt, seq.public)
        tokens = seq.tokens[start * BLOCK_SIZE : (start + count) * BLOCK_SIZE]
        self.step(commits=[CommitOp(sequence_id, block_ids, tokens)])
        seq.num_committed += count

    # ------------------------------------------------------------ worker calls

    @rule(
        tokens=prompts,
        salt=salts,
        public=publics,
        prefill=st.booleans(),
        cache_policy=cache_policies,
        retention=retentions,
    )
    def admit(self, tokens, salt, public, prefill, cache_policy, retention):
        self.history.append((tokens, salt, public))
        self.admit_prompt(tokens, salt, public, prefill, cache_policy, retention)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), extra=_tokens, prefill=st.booleans())
    def admit_again(self, data, extra, prefill):
        """A prompt seen before (cached unless evicted), maybe with a different ending."""
        tokens, salt, public = data.draw(st.sampled_from(self.history))
        keep = data.draw(st.integers(1, len(tokens)))
        self.admit_prompt(tokens[:keep] + extra, salt, public, prefill)

    def admit_prompt(self, tokens, salt, public, prefill, cache_policy=CachePolicy.STORE, retention=0):
        sequence_id = self.next_id
        self.next_id += 1
        expected = self.directory.lookup(tokens, salt, public, self.pool_id)[0].num_cached_tokens
        if cache_policy is CachePolicy.NONE:
            expected = 0  # looks nothing up
        before = snapshot(self.directory)
        others = self.held_by_others(None)
        admit = AdmitOp(sequence_id, tokens, salt, public, cache_policy, retention)
        result = self.step(admits=[admit]).admits[0]
        if not result.admitted:
            pools, pins, last = snapshot(self.directory)
            assert (tuple(p[:-1] for p in pools), pins, last) == (
                tuple(p[:-1] for p in before[0]),
                before[1],
                before[2],
            ), "a failed admission changed state"
            return
        assert result.num_cached_tokens == expected, "admit and lookup disagree"
        assert len(result.block_ids) == -(-len(tokens) // BLOCK_SIZE)
        num_hits = result.num_cached_tokens // BLOCK_SIZE
        num_device_hits = num_hits - len(result.loads) - len(result.shared_loads)
        first_fetch = num_hits - len(result.shared_loads)
        assert [b for b, _ in result.loads] == list(result.block_ids[num_device_hits:first_fetch])
        assert [s.block_id for s in result.shared_loads] == list(result.block_ids[first_fetch:num_hits])
        for block_id, host_block_id in result.loads:  # the worker copies before its forward
            self.kv[block_id] = self.host_kv.get(host_block_id)
        for i, load in enumerate(result.shared_loads, first_fetch):  # ... and fetches
            value = self.store.get(load.block_hash)
            if value is None or value[0] != _header(load):  # a miss: computed by the sequence itself
                self.missing.append(load.block_hash)
                for j in range(i, num_hits):
                    self.kv[result.block_ids[j]] = kv_key(tokens, j, salt, public)
                break
            self.kv[load.block_id] = value[1]
        for i in range(num_hits):  # every hit holds exactly the K/V this prompt needs
            assert self.kv.get(result.block_ids[i]) == kv_key(tokens, i, salt, public), "wrong KV served"
        fresh = set(result.block_ids[num_device_hits:])
        assert not fresh & others, "a block held by someone else was handed out"
        self.live[sequence_id] = seq = WorkerSequence(
            list(tokens), salt, public, list(result.block_ids), num_device_hits * BLOCK_SIZE
        )
        if prefill and len(tokens) // BLOCK_SIZE > seq.num_committed:
            self.commit_next(sequence_id, len(tokens) // BLOCK_SIZE - seq.num_committed)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit(self, data):
        sequence_id = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.live[sequence_id]
        num_full = len(seq.tokens) // BLOCK_SIZE
        if num_full <= seq.num_committed:
            return
        self.commit_next(sequence_id, data.draw(st.integers(1, num_full - seq.num_committed)))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def decode(self, data, new_tokens):
        sequence_id = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.live[sequence_id]
        if len(seq.tokens) + len(new_tokens) > MAX_TOKENS:
            return
        others = self.held_by_others(sequence_id)
        result = self.step(grows=[GrowOp(sequence_id, len(seq.tokens) + len(new_tokens))]).grows[0]
        if result.grown:
            assert not set(result.new_block_ids) & others, "grow handed out a held block"
            seq.table.extend(result.new_block_ids)
            seq.tokens.extend(new_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        """Commit whatever full blocks are left, then release: the usual end of a request."""
        sequence_id = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.live[sequence_id]
        if len(seq.tokens) // BLOCK_SIZE > seq.num_committed:
            self.commit_next(sequence_id, len(seq.tokens) // BLOCK_SIZE - seq.num_committed)
        self.step(releases=[ReleaseOp(sequence_id)])
        del self.live[sequence_id]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        sequence_id = data.draw(st.sampled_from(sorted(self.live)))
        self.step(releases=[ReleaseOp(sequence_id)])
        del self.live[sequence_id]

    @rule(data=st.data())
    def bad_step_changes_nothing(self, data):
        ops = data.draw(
            st.sampled_from(
                [
                    {"admits": [AdmitOp(self.next_id, [])]},  # empty prompt
                    {"releases": [ReleaseOp(10**9)]},  # unknown sequence
                    {"admits": [AdmitOp(self.next_id, [0] * (MAX_TOKENS + 1))]},  # too long
                    {"admits": [AdmitOp(self.next_id, [1]), AdmitOp(self.next_id, [2])]},  # same id twice
                ]
            )
        )
        if self.live:
            sequence_id = data.draw(st.sampled_from(sorted(self.live)))
            seq = self.live[sequence_id]
            ops = data.draw(
                st.sampled_from(
                    [
                        ops,
                        {"releases": [ReleaseOp(sequence_id), ReleaseOp(sequence_id)]},  # double release
                        {"admits": [AdmitOp(sequence_id, [1])]},  # duplicate id
                        {"commits": [CommitOp(sequence_id, [NUM_BLOCKS + 1], [0] * BLOCK_SIZE)]},  # foreign
                        {
                            "commits": [CommitOp(sequence_id, seq.table[seq.num_committed :][:1], [0])]
                        },  # partial
                        {"releases": [ReleaseOp(sequence_id)], "grows": [GrowOp(sequence_id, 1)]},  # gone
                        {"grows": [GrowOp(sequence_id, MAX_TOKENS + 1)]},  # beyond the limit
                    ]
                )
            )
        before = snapshot(self.directory)
        with pytest.raises(DirectoryError):
            self.step(**ops)
        assert snapshot(self.directory) == before

    # ------------------------------------------------------------ operator calls

    @rule(tokens=prompts, salt=salts, public=publics)
    def pin(self, tokens, salt, public):
        """A pin holds the cached prefix (nothing, when nothing is cached); one past the
        pin budget is refused and changes nothing."""
        match = self.directory.lookup(tokens, salt, public, self.pool_id)[0]
        # pins hold device blocks
        cached = match.num_cached_tokens - match.num_host_cached_tokens - match.num_shared_cached_tokens
        pool = self.directory._slots[self.pool_id].pool
        newly = sum(
            1 for b in pool.match(make_prompt(tokens, salt, public, MAX_TOKENS, "t")) if not b.pin_count
        )
        over = pool.num_pinned + newly > int(self.config.pin_budget * NUM_BLOCKS)
        if over:
            before = snapshot(self.directory)
            with pytest.raises(ResourceExhausted):
                self.directory.pin(tokens, salt, public, ttl_seconds=5)
            assert snapshot(self.directory) == before
            return
        result = self.directory.pin(tokens, salt, public, ttl_seconds=5)
        assert result.num_pinned_tokens == cached
        assert pool.num_pinned <= self.config.pin_budget * NUM_BLOCKS
        self.pins.append(result.pin_id)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        pin_id = data.draw(st.sampled_from(self.pins))
        self.directory.unpin(pin_id)
        self.pins.remove(pin_id)

    @rule(salt=st.sampled_from([None, "a", "b"]), tier=st.sampled_from([None, Tier.DEVICE, Tier.HOST]))
    def flush(self, salt, tier):
        pool = self.directory._slots[self.pool_id].pool
        matching = [b for b in pool.index.values() if salt is None or b.chain_salt == salt]
        result = self.directory.flush(cache_salt=salt, tier=tier)
        rows = {row[0]: row[1:] for row in result.tiers}
        assert result.dropped == sum(d for d, _ in rows.values())
        if tier in (None, Tier.DEVICE):
            dropped, busy = rows[Tier.DEVICE]
            assert dropped + busy == len(matching)
            assert busy == sum(1 for b in matching if b.ref_count)
            assert not any(
                b.ref_count == 0 for b in pool.index.values() if salt is None or b.chain_salt == salt
            )
        if pool.host is not None and tier in (None, Tier.HOST):
            left = [b for b in pool.host.index.values() if salt is None or b.chain_salt == salt]
            assert rows[Tier.HOST][1] == len(left), "busy host blocks are the ones left"
            assert all(b.host_refs or b.num_host_children for b in left)

    @rule(seconds=st.sampled_from([1.0, 3.0, 6.0]))
    def time_passes(self, seconds):
        self.clock.advance(seconds)
        self.directory.renew_lease(self.pool_id, self.epoch)
        for pin_id in self.directory.expire_pins():
            self.pins.remove(pin_id)

    # ------------------------------------------------------------ failures and recovery

    @precondition(lambda self: self.num_steps >= 12)
    @rule()
    def lease_lapses(self):
        old_epoch = self.epoch
        self.clock.advance(LEASE_TTL + 1)
        assert self.directory.expire_leases() == [self.pool_id]
        check_invariants(self.directory)
        stats = self.directory.stats(self.pool_id).total
        assert stats.num_free_blocks == NUM_BLOCKS and stats.num_cached_blocks == 0
        with pytest.raises(DirectoryError):
            self.directory.renew_lease(self.pool_id, old_epoch)
        self.live.clear()  # pins survive, holding nothing in this pool any more
        reg = self.directory.register_pool(
            NUM_BLOCKS, BLOCK_SIZE, NAMESPACE, "worker:1", self.pool_id, host=self.host_spec
        )
        assert reg.epoch > old_epoch
        self.epoch, self.pool_token = reg.epoch, reg.pool_token
        self.num_steps = 0

    @precondition(lambda self: self.num_steps >= 12)
    @rule(restart_blockd=st.booleans())
    def reregister_and_resync(self, restart_blockd):
        """The worker registers again (after a blockd restart, or on its own) and
        declares its live sequences; they go on where they were."""
        if restart_blockd:
            self.directory = BlockDirectory(self.config, clock=self.clock, hasher=self.hasher)
            self.pins.clear()
        reg = self.directory.register_pool(
            NUM_BLOCKS, BLOCK_SIZE, NAMESPACE, "worker:1", self.pool_id, self.pool_token, host=self.host_spec
        )
        self.epoch = reg.epoch
        declared = []
        for sequence_id, seq in sorted(self.live.items()):
            num_full = len(seq.tokens) // BLOCK_SIZE
            for i in range(num_full):  # every declared token is written
                self.kv[seq.table[i]] = kv_key(seq.tokens, i, seq.salt, seq.public)
            seq.num_committed = num_full
            declared.append(ResyncSequence(sequence_id, seq.table, seq.tokens, seq.salt, seq.public))
        result = self.directory.resync(self.pool_id, self.epoch, declared)
        assert result.num_sequences == len(declared)
        self.num_steps = 0

    # ------------------------------------------------------------ invariants

    @invariant()
    def directory_invariants_hold(self):
        check_invariants(self.directory)

    @invariant()
    def directory_agrees_with_the_worker(self):
        pool = self.directory._slots[self.pool_id].pool
        assert set(pool.sequences) == set(self.live)
        assert [pin.pin_id for pin in self.directory._pins] == self.pins
        for sequence_id, seq in self.live.items():
            assert pool.sequences[sequence_id].block_ids == seq.table
            assert pool.sequences[sequence_id].num_committed == seq.num_committed

    @invariant()
    def every_cached_block_holds_its_content(self):
        pool = self.directory._slots[self.pool_id].pool
        for block in pool.index.values():
            tokens, depth, node = [], block.depth, block
            while node is not None:
                tokens[:0] = list(memoryview(node.token_bytes).cast("I"))
                node = node.parent
            salted = block.chain_salt or ""
            assert self.kv.get(block.block_id) == (tuple(tokens), salted), "index points at other content"
            assert depth == len(tokens) // BLOCK_SIZE - 1
        if pool.host is None:
            return
        for block in pool.host.index.values():
            tokens, node = [], block
            while node is not None:
                tokens[:0] = list(memoryview(node.token_bytes).cast("I"))
                node = node.parent
            expected = (tuple(tokens), block.chain_salt or "")
            assert self.host_kv.get(block.host_block_id) == expected, "host tier holds other content"


class CollidingDirectoryMachine(DirectoryMachine):
    """Sixteen possible hash values: collisions on many commits and lookups."""

    hasher = BlockHasher(digest=lambda data: bytes([xxhash.xxh3_64_intdigest(data) % 16]) * 16)


class BlindDirectoryMachine(DirectoryMachine):
    """A digest of the block's tokens only, blind to the parent hash and the salt:
    equal blocks under other prefixes or other tenants collide, exactly the cases
    where only the parent and salt checks prevent wrong K/V."""

    hasher = BlockHasher(digest=lambda data: xxhash.xxh3_128_digest(data[-BLOCK_SIZE * 4 :]))


def _header(block) -> tuple:
    """What a shared tier value's header says, as the worker checks it."""
    return (
        block.block_hash,
        block.parent_hash,
        block.token_bytes,
        block.salt_digest,
        block.depth,
        block.chain_digest,
    )


class SharedTierMachine(DirectoryMachine):
    """A shared tier: commits ask for writes, which land late, fail, or land and are
    evicted by the store; fetches of evicted keys miss and are reported. The store is
    one dict that this pool and a second pool of the namespace (re-registered with the
    same spec) see. Every fetched block must hold the K/V its prompt needs."""

    host_spec = HostSpec(has_shared_tier=True)

    @precondition(lambda self: self.writing)
    @rule(data=st.data())
    def writes_finish(self, data):
        hashes = sorted(self.writing)
        done = data.draw(st.lists(st.sampled_from(hashes), unique=True, min_size=1))
        failed = [h for h in done if data.draw(st.booleans()) and data.draw(st.booleans())]
        for block_hash in done:
            value = self.writing.pop(block_hash)
            if block_hash not in failed:
                self.store[block_hash] = value  # the rename: complete, or nothing
        written = [h for h in done if h not in failed]
        self.step(shared_written=written, shared_failed=failed)

    @precondition(lambda self: self.writing)
    @rule()
    def every_write_lands(self):
        done, self.writing = self.writing, {}
        self.store.update(done)
        self.step(shared_written=sorted(done))

    @precondition(lambda self: self.history)
    @rule(data=st.data(), prefill=st.booleans())
    def comes_back_from_the_store(self, data, prefill):
        """The device pool forgets (a device-only flush, as after a worker restart), and a
        prompt seen before comes back: what the store holds is fetched."""
        self.directory.flush(tier=Tier.DEVICE)
        tokens, salt, public = data.draw(st.sampled_from(self.history))
        self.admit_prompt(tokens, salt, public, prefill)

    @precondition(lambda self: self.store)
    @rule(data=st.data())
    def store_evicts(self, data):
        del self.store[data.draw(st.sampled_from(sorted(self.store)))]

    @precondition(lambda self: self.num_steps >= 12)
    @rule()
    def blockd_restarts_and_rebuilds_from_the_store(self):
        """blockd restarts, the worker registers again and resyncs, and the shared index is
        rebuilt from the store's headers as at start (`load_shared`). Under a collision the
        store can hold one chain's block under the hash another chain's child names as its
        parent: only the chain digests keep the rebuild from linking them."""
        self.store.update(self.writing)  # the writes in flight land; nobody reports them
        self.writing, self.missing = {}, []
        self.reregister_and_resync(True)
        seed = self.directory._slots[self.pool_id].pool.seed
        self.directory.load_shared(seed, [SharedRecord(*header) for header, _ in self.store.values()])

    @precondition(lambda self: self.missing)
    @rule()
    def report_missing(self):
        missing, self.missing = self.missing, []
        self.step(shared_missing=missing)

    @invariant()
    def the_shared_index_holds_what_the_store_may_serve(self):
        pool = self.directory._slots[self.pool_id].pool
        shared = pool.shared
        assert shared is not None
        for record in shared.index.values():
            assert record.block_hash not in shared.pending
            assert record.parent is None or shared.index.get(record.parent.block_hash) is record.parent
            assert record.depth == (0 if record.parent is None else record.parent.depth + 1)
            value = self.store.get(record.block_hash)
            if value is not None and value[0] == _header(record):
                tokens, node = [], record
                while node is not None:
                    tokens[:0] = list(memoryview(node.token_bytes).cast("I"))
                    node = node.parent
                content = value[1]
                assert content is not None and content[0] == tuple(tokens), "the store serves other content"


class SharedTierSeenTwiceMachine(SharedTierMachine):
    demote_min_hits = 1


class SharedTierCollidingMachine(SharedTierMachine):
    hasher = CollidingDirectoryMachine.hasher


class SharedAndHostTierMachine(SharedTierMachine):
    """Every tier at once: the walk goes device -> host -> shared."""

    host_spec = HostSpec(NUM_BLOCKS // 2, has_shared_tier=True)


class TieredDirectoryMachine(DirectoryMachine):
    """A host tier half the device pool's size: evictions demote, admissions load."""

    host_spec = HostSpec(NUM_BLOCKS // 2)


class TieredSeenTwiceMachine(DirectoryMachine):
    """Only blocks hit before are demoted (and their parents, which children need)."""

    host_spec = HostSpec(NUM_BLOCKS // 2)
    demote_min_hits = 1


class TieredTinyHostMachine(DirectoryMachine):
    """A host tier of three blocks: demotions of whole chains keep evicting from it."""

    host_spec = HostSpec(3)


class TieredCollidingMachine(TieredDirectoryMachine):
    hasher = CollidingDirectoryMachine.hasher


class TieredBlindMachine(TieredDirectoryMachine):
    hasher = BlindDirectoryMachine.hasher


class LruSeenTwiceDirectoryMachine(DirectoryMachine):
    """The other policy family (strict retention classes, probation for one-use blocks)."""

    policy = "lru+seen2"


class LfudaDirectoryMachine(DirectoryMachine):
    policy = "lfuda"


class SimulatedDirectoryMachine(DirectoryMachine):
    """The opt-in policy chooser (adaptive-sim): its switches re-key the evictable heap."""

    policy = "adaptive-sim"


def _switch_at_every_release(machine: DirectoryMachine) -> None:
    """Make the machine's adaptive-sim policy move on to the next candidate at every
    release it is shown, so the pool re-keys its evictable heap again and again (a real
    switch is rare: a 12-block pool's miniature simulations seldom disagree)."""
    policy = machine.directory._slots[machine.pool_id].pool.leaves.policy
    if "observe" in attributes(policy):
        return

    def observe(blocks, tick, num_blocks) -> bool:
        policy._mode = (policy._mode + 1) % len(policy.CANDIDATES)
        return True

    policy.observe = observe


class SimulatedSwitchingMachine(DirectoryMachine):
    """adaptive-sim, its order switched at every release (`_switch_at_every_release`)."""

    policy = "adaptive-sim"

    def step(self, **ops):
        _switch_at_every_release(self)
        return super().step(**ops)


class SimulatedTieredCollidingMachine(TieredCollidingMachine):
    """The same with a host tier under collisions: demotions follow each order in turn."""

    policy = "adaptive-sim"

    def step(self, **ops):
        _switch_at_every_release(self)
        return super().step(**ops)


_fast = settings(
    max_examples=40, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# The long run: at least 10,000 programs per hasher (pytest -m slow).
_long = settings(
    max_examples=10_000, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _test_case(machine: type[RuleBasedStateMachine], how_long: settings, *marks) -> type:
    case = type(f"Test{machine.__name__}", (machine.TestCase,), {"pytestmark": list(marks)})
    case.settings = how_long
    return case


# The long runs take ~10-20 minutes each on two busy cores: past pytest's default timeout.
_slow = (pytest.mark.slow, pytest.mark.timeout(3 * 3600))
TestDirectoryMachine = _test_case(DirectoryMachine, _fast)
TestCollidingDirectoryMachine = _test_case(CollidingDirectoryMachine, _fast)
TestBlindDirectoryMachine = _test_case(BlindDirectoryMachine, _fast)
TestTieredDirectoryMachine = _test_case(TieredDirectoryMachine, _fast)
TestTieredSeenTwiceMachine = _test_case(TieredSeenTwiceMachine, _fast)
TestTieredTinyHostMachine = _test_case(TieredTinyHostMachine, _fast)
TestTieredCollidingMachine = _test_case(TieredCollidingMachine, _fast)
TestTieredBlindMachine = _test_case(TieredBlindMachine, _fast)
TestLruSeenTwiceDirectoryMachine = _test_case(LruSeenTwiceDirectoryMachine, _fast)
TestLfudaDirectoryMachine = _test_case(LfudaDirectoryMachine, _fast)
TestSimulatedDirectoryMachine = _test_case(SimulatedDirectoryMachine, _fast)
TestSimulatedSwitchingMachine = patches_blockd(_test_case(SimulatedSwitchingMachine, _fast))
TestSimulatedTieredCollidingMachine = patches_blockd(_test_case(SimulatedTieredCollidingMachine, _fast))
TestSharedTierMachine = _test_case(SharedTierMachine, _fast)
TestSharedTierSeenTwiceMachine = _test_case(SharedTierSeenTwiceMachine, _fast)
TestSharedTierCollidingMachine = _test_case(SharedTierCollidingMachine, _fast)
TestSharedAndHostTierMachine = _test_case(SharedAndHostTierMachine, _fast)
TestLongDirectoryMachine = _test_case(DirectoryMachine, _long, *_slow)
TestLongTieredDirectoryMachine = _test_case(TieredDirectoryMachine, _long, *_slow)
TestLongCollidingDirectoryMachine = _test_case(CollidingDirectoryMachine, _long, *_slow)
TestLongBlindDirectoryMachine = _test_case(BlindDirectoryMachine, _long, *_slow)
