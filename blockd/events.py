"""The block event log: what became findable, what stopped being findable.

A bounded ring buffer of numbered events (1, 2, 3, ...). A subscriber replays from
the sequence number it last saw; if the window has moved past it (or it names a
number the log never reached, e.g. after a blockd restart) it gets one GAP event
carrying the newest sequence number: it should reload the state (ListBlocks) and
resume after that number.

Replaying every event from 0 reproduces the index of every pool, per tier: STORED
and LOADED add hashes to the device tier, DEMOTED adds them to the host tier,
REMOVED drops them from its event's tier, CLEARED drops all of one pool's.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from blockd.types import BlockHash, BlockId, PoolId, Tier


class EventKind(enum.Enum):
    STORED = 1
    REMOVED = 2
    CLEARED = 3
    GAP = 4
    DEMOTED = 5
    LOADED = 6


@dataclass(frozen=True, slots=True)
class BlockEvent:
    sequence: int
    kind: EventKind
    pool_id: PoolId | None  # None only for GAP
    block_hashes: tuple[BlockHash, ...] = ()
    block_ids: tuple[BlockId, ...] = ()
    parent_hash: BlockHash | None = None  # STORED: parent of the first hash
    token_bytes: bytes = b""  # STORED/LOADED: the blocks' tokens, uint32 little-endian
    tier: Tier = Tier.DEVICE  # HOST for DEMOTED and the host tier's REMOVED (host block ids)


Listener = Callable[[], None]


class EventLog:
    """Numbered event buffer bounded by count and by retained bytes (a STORED event
    carries its blocks' tokens, so 10,000 events of long prompts could otherwise hold
    gigabytes). The newest event is always kept. `append` is O(1) amortised;
    `read(after)` is O(returned)."""

    def __init__(self, capacity: int, max_bytes: int = 64 * 1024 * 1024) -> None:
        assert capacity >= 1, "the event log needs room for at least one event"
        self._capacity = capacity
        self._max_bytes = max_bytes
        self._events: deque[BlockEvent] = deque()
        self._num_bytes = 0
        self.last_sequence = 0
        self._listeners: list[Listener] = []

    def append(
        self,
        kind: EventKind,
        pool_id: PoolId,
        block_hashes: tuple[BlockHash, ...] = (),
        block_ids: tuple[BlockId, ...] = (),
        parent_hash: BlockHash | None = None,
        token_bytes: bytes = b"",
        tier: Tier = Tier.DEVICE,
    ) -> BlockEvent:
        assert kind is not EventKind.GAP, "GAP is synthesised by read(), never stored"
        self.last_sequence += 1
        event = BlockEvent(
            self.last_sequence, kind, pool_id, block_hashes, block_ids, parent_hash, token_bytes, tier
        )
        self._events.append(event)
        self._num_bytes += _size(event)
        while len(self._events) > 1 and (
            len(self._events) > self._capacity or self._num_bytes > self._max_bytes
        ):
            self._num_bytes -= _size(self._events.popleft())
        for listener in list(self._listeners):
            listener()
        return event

    def read(self, after_sequence: int, pool_id: PoolId | None = None) -> list[BlockEvent]:
        """Events numbered > after_sequence (0: from the oldest retained), optionally of
        one pool; a GAP event first when some of them are no longer retained."""
        oldest = self._events[0].sequence if self._events else self.last_sequence + 1
        if after_sequence > self.last_sequence or 0 < after_sequence < oldest - 1:
            return [BlockEvent(self.last_sequence, EventKind.GAP, None)]
        start = max(0, after_sequence - oldest + 1)
        events = islice(self._events, start, None)
        return [e for e in events if pool_id is None or e.pool_id == pool_id]

    def subscribe(self, listener: Listener) -> None:
        """Call `listener()` after every append (it must not touch the log)."""
        self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        self._listeners.remove(listener)


def _size(event: BlockEvent) -> int:
    """Approximate bytes an event retains."""
    return 64 + len(event.token_bytes) + 24 * len(event.block_hashes) + 8 * len(event.block_ids)
