"""Hold back a waiting request whose prefix another sequence is computing right now (pure).

Blocks become findable only once the forward that wrote them has finished (DESIGN's
commit-after-write rule). Requests that arrive together with a common uncached prefix
would therefore all be admitted in one step, all miss, and all compute the prefix: 16
requests sharing one 4,096-token prefix computed it 8 times (`make bench-peer`, long
prefix). Instead, a waiting request whose full blocks run past what an in-flight
sequence with the same salt has committed waits until that sequence has committed them,
and then hits them like any later request. Invariant: a request waits only on a
sequence that is admitted and still prefilling, so it waits at most until that
sequence's prompt is committed (or it is preempted or finishes, ending the wait).
"""

from __future__ import annotations

from dataclasses import dataclass

from computed.sequence import Sequence

# Sequences remembered per (salt, first block): the ones with the longest committed
# prefixes (what a new admission is known to hit) and every one still computing.
MAX_KNOWN_PER_KEY = 8


@dataclass(frozen=True)
class _Entry:
    token_ids: list[int]
    num_committed_blocks: int
    computing: bool  # still computing blocks of its prompt (admitted now, or prefilling)


class PrefixLeaders:
    """What one scheduling step knows about prompt blocks in flight, by salt and first block.

    Running sequences tell which leading blocks are committed (a new admission sharing
    them will hit them); prefilling and newly admitted ones tell which are still being
    computed (a waiting request sharing those waits). An admission is credited with the
    committed prefix it shares with a known sequence, so requests that follow a computed
    prefix are admitted together, not one per step.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_key: dict[tuple, list[_Entry]] = {}

    def add_running(self, seq: Sequence) -> None:
        self._add(seq, _Entry(seq.token_ids, seq.num_committed_blocks, computing=seq.is_prefilling))

    def add_admitted(self, seq: Sequence) -> None:
        """`seq` is being admitted: it computes its prompt past the prefix known committed."""
        self._add(seq, _Entry(seq.token_ids, self.known_committed_blocks(seq), computing=True))

    def known_committed_blocks(self, seq: Sequence) -> int:
        key = self._key(seq)
        if key is None:
            return 0
        # An entry credits at most its committed blocks, and more than `best` only if it
        # shares block `best` (one block compared first). Without these checks, 63
        # followers admitted behind one leader each compared the whole prefix with every
        # earlier follower: 67 ms of one step's planning (py-spy), now 8-9 ms with the search below.
        best = 0
        for entry in self._by_key.get(key, ()):
            if entry.num_committed_blocks > best and self._shares_more_than(
                seq.token_ids, entry.token_ids, best
            ):
                best = self._common_blocks(
                    seq.token_ids, entry.token_ids, entry.num_committed_blocks, best + 1
                )
        return best

    def should_wait(self, seq: Sequence) -> bool:
        """True when a sequence is still computing full blocks that `seq` would hit."""
        key = self._key(seq)
        if key is None:
            return False
        return any(
            e.computing and self._shares_more_than(seq.token_ids, e.token_ids, e.num_committed_blocks)
            for e in self._by_key.get(key, ())
        )

    def _add(self, seq: Sequence, entry: _Entry) -> None:
        key = self._key(seq)
        if key is None:
            return
        entries = self._by_key.setdefault(key, [])
        if entry.computing or len(entries) < MAX_KNOWN_PER_KEY:
            entries.append(entry)
            return
        # Bounded work per waiting request: keep the longest committed prefixes.
        weakest = min(
            range(len(entries)), key=lambda i: (entries[i].computing, entries[i].num_committed_blocks)
        )
        if (
            not entries[weakest].computing
            and entries[weakest].num_committed_blocks < entry.num_committed_blocks
        ):
            entries[weakest] = entry

    def _key(self, seq: Sequence) -> tuple | None:
        if seq.num_tokens < self.block_size:
            return None  # no full block: nothing to share
        if seq.cache_policy != "store":
            return None  # it stores nothing another could wait for (and NONE reads nothing)
        return seq.cache_salt, seq.public_prefix_tokens, tuple(seq.token_ids[: self.block_size])

    def _shares_more_than(self, a: list[int], b: list[int], num_blocks: int) -> bool:
        """Whether the two token lists share more than `num_blocks` full leading blocks.
        Block `num_blocks` is compared first: requests behind a common prefix usually part
        there, and one block is cheap where the whole prefix is a long slice compare."""
        begin, end = num_blocks * self.block_size, (num_blocks + 1) * self.block_size
        return min(len(a), len(b)) >= end and a[begin:end] == b[begin:end] and a[:begin] == b[:begin]

    def _common_blocks(self, a: list[int], b: list[int], at_most: int, at_least: int = 0) -> int:
        """Full leading blocks the two token lists share, capped at `at_most`, given that
        they share `at_least` (one C-speed list comparison when they share all of them,
        else a binary search that compares only the blocks past what is known shared:
        about one more pass over the tokens, where comparing whole prefixes took ~7)."""
        bs = self.block_size
        high = min(at_most, min(len(a), len(b)) // bs)
        if a[: high * bs] == b[: high * bs]:
            return high
        low, high = min(at_least, high - 1), high - 1  # invariant: blocks [0, low) are shared
        while low < high:
            mid = (low + high + 1) // 2
            if a[low * bs : mid * bs] == b[low * bs : mid * bs]:
                low = mid
            else:
                high = mid - 1
        return low
