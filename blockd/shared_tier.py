"""The shared tier as blockd tracks it: which blocks of each namespace a Valkey/Redis
store holds, so an admission on any worker of the namespace finds them.

The store outlives workers and blockd; blockd's index of it is a cache of what the
store holds, corrected when a fetch finds a value gone (server-side eviction, a store
that restarted empty) and rebuilt from the store's headers when blockd starts. Unlike
the device pool and the host tier, it is not one worker's: records are per namespace
(the pools' hash seed), shared by every pool of it, so a record's parent is another
`SharedRecord`, never a pool's `Block`.

Residency, in order ("findable only after its bytes are completely there"):

1. *pending*: blockd asked a worker to write a committed block (`StepResult.shared_stores`);
   nobody can find it.
2. *resident*: the worker reported the write done (the value sits under its key), and
   its parent is resident (or it is a first block): an admission's walk finds it.
3. gone: the write failed, a fetch found the value missing or wrong, a flush dropped
   it, or its parent went. Descendants of a record that leaves go with it (they could
   never be reached by a walk).

Identity (what a hit compares): the parent record and `identity`, which is the block's
tokens, preceded for the salted block by a one-way digest of its salt tag (the store
never holds a salt, and blockd rebuilds records from the store). Equal hashes alone
never decide. `chain_digest` names a record's whole chain (its parent's chain digest
and its identity, `kvcache_contract.shared_value.chain_digest`): computed from the
verified parent record when blockd asks for a write, written into the value's header,
and checked when a rebuild links a value under the one its parent hash names.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from blockd.hashing import BlockHasher, block_width
from blockd.prompt import Prompt
from blockd.types import BlockHash, PoolId
from kvcache_contract.shared_value import chain_digest, identity, salt_digest


def identity_of(payload: bytes, width: int) -> tuple[bytes, bytes | None]:
    """(identity, salt digest or None) of a block's hash payload (salt tag + tokens)."""
    if len(payload) == width:
        return payload, None
    digest = salt_digest(payload[:-width])
    return identity(payload[-width:], digest), digest


@dataclass
class SharedCounters:
    """One pool's use of the shared tier (cumulative, like PoolCounters)."""

    hit_tokens: int = 0
    num_stores: int = 0  # blocks this pool wrote that became resident
    num_loads: int = 0  # blocks this pool was told to fetch
    num_missing: int = 0  # records dropped because this pool's fetch found no valid value
    num_loads_skipped: int = 0
    num_write_failures: int = 0


class SharedRecord:
    __slots__ = (
        "block_hash",
        "chain_digest",
        "chain_salt_digest",
        "children",
        "depth",
        "identity",
        "is_resident",
        "parent",
        "parent_hash",
        "salt_digest",
        "token_bytes",
    )

    def __init__(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_bytes: bytes,
        salt_digest: bytes | None,
        depth: int,
        chain: bytes,
    ) -> None:
        """`chain`: the record's chain digest (`chain_of` for a record blockd makes; what
        the value's header says for one read back from the store)."""
        self.block_hash = block_hash
        self.parent_hash = parent_hash
        self.token_bytes = token_bytes
        self.salt_digest = salt_digest
        self.identity = identity(token_bytes, salt_digest)
        self.depth = depth
        self.parent: SharedRecord | None = None
        self.children: list[SharedRecord] = []
        self.is_resident = False
        self.chain_salt_digest: bytes | None = salt_digest
        self.chain_digest = chain


def chain_of(parent: SharedRecord | None, block_identity: bytes) -> bytes:
    """The chain digest of a block with this identity (`shared_value.identity`) under
    `parent` (None: a first block): what a write stamps and a rebuild checks."""
    return chain_digest(parent.chain_digest if parent is not None else None, block_identity)


@dataclass(frozen=True, slots=True)
class PendingStore:
    record: SharedRecord
    pool_id: PoolId
    # The record the block's parent is in this index (resident or pending), checked
    # against the writer's chain level by level (`SharedIndex.record_of`); None for a
    # first block. Equal hashes alone never decide: under a hash collision another
    # chain's record may sit under the parent's hash, and linking to it would serve
    # this block's K/V to that chain's prompts.
    parent: SharedRecord | None


# Writes under way at a flush that `SharedIndex.flushed` remembers, per namespace: a
# worker writes at most a Step's stores at a time, far fewer than this.
MAX_FLUSHED_WRITES = 1 << 16


class SharedIndex:
    """The shared tier's records of one namespace (one hash seed).

    Bounded: past `max_blocks` records, the least recently used ones leave the index
    (with their descendants), oldest first. Their values stay in the store until the
    server evicts them; forgetting a record costs a miss, never wrong K/V. Admissions
    touch their chains child first, so a parent is always more recent than its
    children and the least recent records are the tails of cold chains."""

    def __init__(self, seed: BlockHash, hasher: BlockHasher, max_blocks: int = 1 << 20) -> None:
        assert max_blocks >= 1, "the shared index holds at least one block"
        self.seed = seed
        # Resident records, least recently used first.
        self.index: OrderedDict[BlockHash, SharedRecord] = OrderedDict()
        self.pending: dict[BlockHash, PendingStore] = {}
        # Writes a flush forgot while they were under way, oldest first (bounded): the key
        # such a write leaves behind is deleted when its report comes (`confirm`).
        self.flushed: OrderedDict[BlockHash, None] = OrderedDict()
        self.max_blocks = max_blocks
        self.num_forgotten = 0  # records dropped to stay within max_blocks
        self._hasher = hasher

    def __len__(self) -> int:
        return len(self.index)

    # ------------------------------------------------------------ queries

    def match(self, prompt: Prompt, block_size: int, known: Seq[BlockHash] = ()) -> list[SharedRecord]:
        """Verified resident records of the prompt's leading full blocks, from block 0:
        each one's parent is the previous hit and its identity equals the block's.
        `known`: the hashes of the prompt's leading blocks the admission's walk already
        computed (its device and host hits): they are looked up, not hashed again, so
        an admission hashes each block once whatever tiers it walks."""
        if not self.index:
            return []
        payloads = prompt.payloads(block_size)
        lookup = self.index.get
        candidates: list[SharedRecord] = []
        for block_hash in known:
            record = lookup(block_hash)
            if record is None:
                break
            candidates.append(record)
        if len(candidates) == len(known):  # the chain may go on past the known blocks
            start = known[-1] if known else self.seed
            candidates += self._hasher.walk(start, payloads[len(known) :], lookup)
        width = block_width(block_size)
        hits: list[SharedRecord] = []
        parent: SharedRecord | None = None
        for record, payload in zip(candidates, payloads):
            identity, _ = identity_of(payload, width)
            if record.parent is not parent or record.identity != identity:
                break
            hits.append(record)
            parent = record
        return hits

    def touch(self, records: list[SharedRecord]) -> None:
        """An admission used this chain (parent first): most recent, parents above children."""
        move = self.index.move_to_end
        for record in reversed(records):
            move(record.block_hash)

    def is_known(self, block_hash: BlockHash) -> bool:
        return block_hash in self.index or block_hash in self.pending

    # ------------------------------------------------------------ residency

    def known_record(self, block_hash: BlockHash) -> SharedRecord | None:
        """The record under this hash, resident or pending (None: neither)."""
        record = self.index.get(block_hash)
        if record is not None:
            return record
        store = self.pending.get(block_hash)
        return store.record if store is not None else None

    def parent_of(self, record: SharedRecord) -> SharedRecord | None:
        """A resident record's parent, or the parent a pending one was written under."""
        if record.is_resident:
            return record.parent
        store = self.pending.get(record.block_hash)
        return store.parent if store is not None and store.record is record else None

    def add_pending(self, record: SharedRecord, pool_id: PoolId, parent: SharedRecord | None) -> None:
        """`parent`: the record of the block's parent, verified by the caller to be this
        chain's (not only this hash's); None for a first block."""
        assert not self.is_known(record.block_hash), "one record per hash"
        assert (parent is None) == (record.parent_hash is None), "a first block has no parent"
        self.pending[record.block_hash] = PendingStore(record, pool_id, parent)

    def confirm(
        self, pool_id: PoolId, block_hashes: Iterable[BlockHash]
    ) -> tuple[list[SharedRecord], list[SharedRecord], list[BlockHash]]:
        """The pool's writes of these blocks completed: each becomes resident when its
        parent is (checked parent first); answers the records that did, those the
        index forgot to stay within its bound, and the orphans: writes a flush forgot
        while they were under way, and writes whose parent never became resident (their
        keys only take room in the store, and a rebuild would bring a flushed one back)."""
        hashes = list(block_hashes)
        stores = [self.pending.get(h) for h in hashes]
        orphans = [h for h, s in zip(hashes, stores) if s is None and h in self.flushed]
        for block_hash in orphans:
            del self.flushed[block_hash]
        mine = [s for s in stores if s is not None and s.pool_id == pool_id]
        for store in mine:
            del self.pending[store.record.block_hash]
        resident: list[SharedRecord] = []
        for store in sorted(mine, key=lambda s: s.record.depth):
            record, parent = store.record, store.parent
            if parent is not None and not (
                parent.is_resident and self.index.get(parent.block_hash) is parent
            ):
                # its parent never made it (or left): it could never be reached, and its
                # value only takes room in the store
                orphans.append(record.block_hash)
                continue
            self._place(record, parent)
            resident.append(record)
        return resident, self._keep_within_bounds(), orphans

    def fail(self, pool_id: PoolId, block_hashes: Iterable[BlockHash]) -> int:
        num = 0
        for block_hash in block_hashes:
            store = self.pending.get(block_hash)
            if store is not None and store.pool_id == pool_id:
                del self.pending[block_hash]
                num += 1
        return num

    def forget_pool(self, pool_id: PoolId) -> None:
        """The pool was reset: its writes in flight will never be reported."""
        for block_hash in [h for h, s in self.pending.items() if s.pool_id == pool_id]:
            del self.pending[block_hash]

    def drop(self, block_hashes: Iterable[BlockHash]) -> list[SharedRecord]:
        """Records whose values are gone leave, and their descendants with them."""
        dropped: list[SharedRecord] = []
        for block_hash in block_hashes:
            record = self.index.get(block_hash)
            if record is not None:
                self._remove_subtree(record, dropped)
        return dropped

    def flush(self, salt_digest: bytes | None) -> list[SharedRecord]:
        """Drop every record (of chains carrying this salt digest if given), and forget the
        stores still pending for those chains: a write that finished just before the flush
        deleted its key would otherwise be confirmed after it, a record of nothing."""
        flushed = self.flushed
        for block_hash, store in list(self.pending.items()):
            if salt_digest is None or store.record.chain_salt_digest == salt_digest:
                del self.pending[block_hash]
                flushed[block_hash] = None
        while len(flushed) > MAX_FLUSHED_WRITES:
            flushed.popitem(last=False)
        matching = [
            r for r in self.index.values() if salt_digest is None or r.chain_salt_digest == salt_digest
        ]
        return self.drop([r.block_hash for r in sorted(matching, key=lambda r: r.depth)])

    def load(self, records: Iterable[SharedRecord]) -> tuple[int, list[SharedRecord]]:
        """Records read back from the store (a rebuild), parent first: each is linked
        under the resident record its parent hash names only when its chain digest is
        that record's chained with its own identity (under a collision the record there
        is another chain's); a record whose parent is not resident, or whose digest does
        not chain, is left out (a miss, never wrong K/V). Answers how many became
        resident, and the records the index forgot to stay within its bound."""
        num = 0
        for record in sorted(records, key=lambda r: r.depth):
            if record.block_hash in self.index:
                continue
            parent = None
            if record.parent_hash is not None:
                parent = self.index.get(record.parent_hash)
                if parent is None or parent.depth != record.depth - 1:
                    continue
            elif record.depth != 0:
                continue
            if record.chain_digest != chain_of(parent, record.identity):
                continue
            self.pending.pop(record.block_hash, None)
            self._place(record, parent)
            num += 1
        return num, self._keep_within_bounds()

    # ------------------------------------------------------------ private helpers

    def _place(self, record: SharedRecord, parent: SharedRecord | None) -> None:
        record.parent = parent
        record.is_resident = True
        if parent is not None:
            parent.children.append(record)
            if record.salt_digest is None:
                record.chain_salt_digest = parent.chain_salt_digest
        self.index[record.block_hash] = record

    def _keep_within_bounds(self) -> list[SharedRecord]:
        """Forget the least recently used records (and their descendants) past the
        bound; answers them (a REMOVED event's worth)."""
        index = self.index
        forgotten: list[SharedRecord] = []
        while len(index) > self.max_blocks:
            dropped: list[SharedRecord] = []
            self._remove_subtree(next(iter(index.values())), dropped)
            self.num_forgotten += len(dropped)
            forgotten += dropped
        return forgotten

    def _remove_subtree(self, root: SharedRecord, dropped: list[SharedRecord]) -> None:
        stack = [root]
        while stack:
            record = stack.pop()
            if not record.is_resident:
                continue
            record.is_resident = False
            del self.index[record.block_hash]
            dropped.append(record)
            stack.extend(record.children)
            record.children = []
        parent = root.parent
        if parent is not None and root in parent.children:
            parent.children.remove(root)


class SharedTier:
    """Every namespace's shared index (created on first use: a pool registering, or a
    rebuild finding its keys)."""

    def __init__(self, hasher: BlockHasher, max_blocks: int = 1 << 20) -> None:
        self._hasher = hasher
        self._max_blocks = max_blocks  # per namespace
        self.namespaces: dict[BlockHash, SharedIndex] = {}

    def index_for(self, seed: BlockHash) -> SharedIndex:
        index = self.namespaces.get(seed)
        if index is None:
            index = self.namespaces[seed] = SharedIndex(seed, self._hasher, self._max_blocks)
        return index
