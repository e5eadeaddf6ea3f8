"""What a pool remembers about blocks it no longer holds, and why a prompt missed.

`GhostTable`: the hashes of the last `capacity` blocks that left the index (evicted
by a policy, dropped by a flush, or never stored because their request's
cache_policy said so), with when and why and how often they had been used. Fixed
size: the oldest ghost is forgotten first (a dict and a FIFO of its entries, O(1)
amortised per operation), so memory is bounded whatever the traffic. It serves two
readers:

- the policies: a block committed again with a remembered hash gets its earlier
  uses back (`Block.num_seen`), as ARC and S3-FIFO promote a ghost hit, so a block
  that keeps coming back is not treated as a one-off each time;
- miss reasons: for each admission the pool classifies its uncached tokens.

Miss reasons. A prefix walk ends at the first missing block, and every later block
of the prompt misses because of it (a child is never reachable without its parent),
so the uncached full-block tokens get the reason of that first missing block; the
partial tail (tokens after the last full block) is `PARTIAL_BLOCK`, never
cacheable. Costs one extra digest per admission that misses (the missing block's
salt-free hash), plus the ghost lookup; never a walk of the rest of the prompt.

Pure: no gRPC, no I/O; time comes from the injected clock.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from blockd.admission import KeyMemory
from blockd.eviction import POLICIES, GatedPolicy
from blockd.hashing import BlockHasher, salt_tag
from blockd.prompt import Prompt
from blockd.types import BlockHash

if TYPE_CHECKING:
    from blockd.block import Block, Hashed


class MissReason(enum.Enum):
    """Why uncached prompt tokens were not served from the cache. Values are the
    names used in stats, metrics labels and the proto enum (MISS_REASON_<NAME>)."""

    PARTIAL_BLOCK = "partial_block"  # after the last full block: never cached
    NEVER_SEEN = "never_seen"  # this pool never held (or no longer remembers) the block
    EVICTED = "evicted"  # held once, evicted by the policy (the ghost says when)
    FLUSHED = "flushed"  # held once, dropped by an operator's flush
    NOT_STORED = "not_stored"  # computed before, but its request's cache_policy kept it out
    OTHER_SALT = "other_salt"  # the same tokens are cached under another salt (or none)
    OTHER_NAMESPACE = "other_namespace"  # cached in a pool of another model/revision/dtype/adapter
    NOT_LOADED = "not_loaded"  # only in a lower tier this admission did not load (tiers)
    BYPASSED = "bypassed"  # the request's cache_policy was NONE: nothing was looked up
    NOT_ADMITTED = "not_admitted"  # cached once, on probation (key not seen before), evicted


# Hashes the key memory (blockd.admission) tracks per ghost: with the default 2 ghosts
# per block, 8x the pool. The admission gate needs several times the pool (measured:
# bench.eviction_quality); 1.25 bytes each, against ~200 per ghost.
KEYS_PER_GHOST = 4

# their one-use victims were never admitted (SimulatedPolicy: whichever order it followed)
GATED_POLICIES = frozenset(name for name, cls in POLICIES.items() if issubclass(cls, GatedPolicy))

# A ghost table's entry: (cause, at, num_uses, run_length, block_hash), `Ghost`'s fields and
# the hash. Typed as a tuple of any length on purpose: mypyc (blockd.native) keeps a
# fixed-length tuple as a C struct and boxes a new object at each store, so the dict's and
# the FIFO's copies would never be the same object (`GhostTable._order` tests identity).
_Entry = tuple[Any, ...]
_SLACK = 64  # stale FIFO entries tolerated beyond the capacity before a compaction

# Ghost causes that are reasons of their own (an eviction's cause is the policy name).
FLUSH = "flush"
NOT_STORED = "cache_policy"


@dataclass(frozen=True, slots=True)
class Ghost:
    """A block hash the pool no longer indexes."""

    cause: str  # the evicting policy's name, FLUSH or NOT_STORED
    at: float  # clock seconds when it left
    num_uses: int  # commits and hits it had had (carried into a recommit)
    run_length: int = 0  # the uncached blocks its sequence brought (Block.run_length)

    @property
    def not_admitted(self) -> bool:
        """Evicted by the admission gate's policy while on probation (used once, its key
        not seen before): the block was cached but never admitted (MISS_REASON_NOT_ADMITTED)."""
        return self.cause in GATED_POLICIES and self.num_uses < 2

    @property
    def reason(self) -> MissReason:
        if self.cause == FLUSH:
            return MissReason.FLUSHED
        if self.cause == NOT_STORED:
            return MissReason.NOT_STORED
        if self.not_admitted:
            return MissReason.NOT_ADMITTED
        return MissReason.EVICTED


@dataclass(frozen=True, slots=True)
class Miss:
    """The classification of one admission's uncached tokens."""

    reason: MissReason | None  # of the full-block misses; None: every full block hit
    num_tokens: int  # full-block tokens not served from cache
    num_partial_tokens: int  # the partial tail
    first_missing_block: int
    ghost: Ghost | None = None  # for EVICTED / FLUSHED / NOT_STORED


class GhostTable:
    """The last `capacity` hashes that left a pool's index (see the module docstring);
    also the salt-free hashes of the pool's cached salted blocks (for OTHER_SALT).

    Invariants: len(self) <= capacity; a hash is never both a ghost and indexed in the
    pool (committing a ghost takes it out, `recall`); `salted[h]` counts the cached
    blocks whose salt-free hash is h."""

    def __init__(
        self,
        capacity: int,
        clock: Callable[[], float],
        on_return: Callable[[int, int], None] | None = None,
    ) -> None:
        assert capacity >= 0, "capacity must be >= 0"
        self.capacity = capacity
        self._clock = clock
        self._on_return = on_return  # the policy's `returned`: a ghost came back
        # hash -> (cause, at, num_uses, run_length, hash): a Ghost is built only when one is
        # asked for (a tuple per evicted block, not a frozen dataclass: `remember` runs once
        # per eviction, bench.blockd_grpc evicts a 128-block chain per admission).
        self._ghosts: dict[BlockHash, _Entry] = {}
        # Every entry `remember` made, oldest first; an entry is live while `_ghosts` maps its
        # hash to it (the same object), else stale (recalled, or remembered again later:
        # its newer entry is further back). So the live entries are in the order of their
        # hashes' last `remember`, the order an OrderedDict moved to its end kept, and the
        # oldest live one is forgotten first. A plain dict and this FIFO cost one dict
        # operation per remember, recall or expiry where the OrderedDict cost two
        # (bench.blockd_inprocess). Stale entries are dropped when they reach the front,
        # or all at once when they outnumber the live ones (`_compact`).
        self._order: deque[_Entry] = deque()
        self.salted: dict[BlockHash, int] = {}
        # Every hash that left, for far longer than the ghosts (hash only, approximate).
        self.keys = KeyMemory(int(KEYS_PER_GHOST * capacity))

    def __len__(self) -> int:
        return len(self._ghosts)

    def __bool__(self) -> bool:
        """Whether a recall can answer anything (the commit path skips it otherwise, so
        a pool without pressure pays nothing for the memory)."""
        return bool(self._ghosts) or self.keys.num_added > 0

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._ghosts

    def get(self, block_hash: BlockHash) -> Ghost | None:
        entry = self._ghosts.get(block_hash)
        return Ghost(entry[0], entry[1], entry[2], entry[3]) if entry is not None else None

    def remember(self, hashes_and_uses: list[tuple[BlockHash, int, int]], cause: str) -> None:
        """Blocks that just left the index (or were never stored), oldest first: each
        (hash, uses, run length: `Block.run_length`, which the policy learns by)."""
        if self.capacity:
            now = self._clock()
            self._add([(cause, now, uses, run, block_hash) for block_hash, uses, run in hashes_and_uses])

    def remember_blocks(self, blocks: list[Block], cause: str) -> None:
        """`remember` of records that just left the index (evicted or flushed), oldest
        first, each with its uses so far (commit and hits) and run length: read from the
        records, with no (hash, uses, run) tuple per block (`BlockPool._evict`,
        bench.blockd_inprocess)."""
        if self.capacity:
            now = self._clock()
            self._add([(cause, now, b.num_seen + b.num_hits, b.run_length, b.block_hash) for b in blocks])

    def _add(self, entries: list[_Entry]) -> None:
        """Remember `entries` (oldest first; a remembered hash's earlier entry goes stale),
        then forget the oldest ghosts past the capacity."""
        ghosts, append = self._ghosts, self._order.append
        for entry in entries:
            ghosts[entry[4]] = entry
            append(entry)
        self.keys.add_many([entry[4] for entry in entries])
        self._forget_oldest()

    def _forget_oldest(self) -> None:
        """Forget the oldest ghosts past the capacity (the FIFO's stale entries on the way
        are dropped), and compact the FIFO when stale entries outnumber live ones."""
        ghosts, order, capacity = self._ghosts, self._order, self.capacity
        if len(ghosts) > capacity:
            popleft, pop = order.popleft, ghosts.pop
            while len(ghosts) > capacity:
                oldest = popleft()
                live = pop(oldest[4], None)
                if live is not oldest and live is not None:  # stale: its live entry is younger
                    ghosts[oldest[4]] = live
        if len(order) > 2 * capacity + _SLACK:
            self._compact()

    def _compact(self) -> None:
        """Drop the FIFO's stale entries (recalled ghosts leave theirs behind): at most
        one pass per `capacity` remembers, so O(1) amortised."""
        ghosts = self._ghosts
        self._order = deque([entry for entry in self._order if ghosts.get(entry[4]) is entry])

    def recall(self, block_hash: BlockHash) -> int:
        """A block with this hash is indexed again: forget its ghost, answer the uses
        it remembered: the ghost's count, else 1 when only the key memory still knows
        the hash (seen before, how often forgotten), else 0."""
        entry = self._ghosts.pop(block_hash, None)
        if entry is None:
            return 1 if block_hash in self.keys else 0
        cause, _, num_uses, run_length, _ = entry
        # Every victim of the policy that returns teaches it (EVICTED and NOT_ADMITTED
        # alike: the gate opens on probation victims' returns); a flush or cache_policy
        # is no verdict on the policy. Teaching only EVICTED ghosts left the gate unable to
        # open once NOT_ADMITTED became a reason of its own (0.54-0.76x lru on the
        # conversation trace, bench.eviction_quality).
        if self._on_return is not None and cause != FLUSH and cause != NOT_STORED:
            self._on_return(num_uses, run_length)
        return num_uses

    def recall_many(self, hashes: list[BlockHash]) -> list[int]:
        """`[self.recall(h) for h in hashes]`, with the same effects (ghosts forgotten, the
        policy taught each return, in order), in one call: the hashes no ghost answers
        are asked of the key memory at once (`KeyMemory.contains_many`). A commit run's
        recall (`BlockPool`, bench.blockd_inprocess)."""
        pop = self._ghosts.pop
        entries = [pop(block_hash, None) for block_hash in hashes]
        missing = [block_hash for block_hash, entry in zip(hashes, entries) if entry is None]
        # Key-memory queries change nothing, and `on_return` (the policy) reads no ghost, so
        # asking them before the returns are told leaves the same state as `recall` in turn.
        if len(missing) == len(entries):
            return [1 if known else 0 for known in self.keys.contains_many(missing)]
        known = iter(self.keys.contains_many(missing))
        on_return = self._on_return
        uses: list[int] = []
        append = uses.append
        for entry in entries:
            if entry is None:
                append(1 if next(known) else 0)
                continue
            cause, _, num_uses, run_length, _ = entry
            if on_return is not None and cause != FLUSH and cause != NOT_STORED:
                on_return(num_uses, run_length)
            append(num_uses)
        return uses

    def add_salted(self, salt_free_hash: BlockHash) -> None:
        self.salted[salt_free_hash] = self.salted.get(salt_free_hash, 0) + 1

    def drop_salted(self, salt_free_hash: BlockHash) -> None:
        left = self.salted[salt_free_hash] - 1
        if left:
            self.salted[salt_free_hash] = left
        else:
            del self.salted[salt_free_hash]

    def clear(self) -> None:
        self._ghosts.clear()
        self._order.clear()
        self.keys.clear()


def classify_miss(
    prompt: Prompt,
    block_size: int,
    hits: Sequence[Hashed],
    seed: BlockHash,
    hasher: BlockHasher,
    index: Mapping[BlockHash, object],
    ghosts: GhostTable,
) -> Miss:
    """Why the prompt's tokens after its verified `hits` are not cached: the reason of
    its first missing full block, and the partial tail. One digest for the missing
    block (the walk stopped there), one more for its salt-free hash when no ghost
    explains it."""
    num_tokens = prompt.num_tokens
    num_full = num_tokens // block_size
    num_partial = num_tokens - num_full * block_size
    k = len(hits)
    if k >= num_full:
        return Miss(None, 0, num_partial, k)
    num_missing = (num_full - k) * block_size
    parent = hits[-1].block_hash if hits else seed
    # payloads(limit=1) spares cutting a cold prompt whole; a warm one was cut by the match
    payload = prompt.payloads(block_size, limit=1)[0] if k == 0 else prompt.payloads(block_size)[k]
    digest = hasher.digest
    ghost = ghosts.get(BlockHash(digest(parent + payload)))
    if ghost is not None:
        return Miss(ghost.reason, num_missing, num_partial, k, ghost)
    salted = k == prompt.salt_block(block_size)
    raw = payload[len(salt_tag(prompt.salt)) :] if salted else payload
    salt_free = BlockHash(digest(parent + raw))
    if (salted and salt_free in index) or salt_free in ghosts.salted:
        return Miss(MissReason.OTHER_SALT, num_missing, num_partial, k)
    return Miss(MissReason.NEVER_SEEN, num_missing, num_partial, k)


def ghost_capacity(num_blocks: int, ratio: float, maximum: int) -> int:
    """Ghosts a pool of `num_blocks` keeps: `ratio` per block, at most `maximum`."""
    return min(maximum, int(num_blocks * ratio))
