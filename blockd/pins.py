"""Pins: references an operator holds on a cached prefix until a deadline.

A pin holds one reference on each block it pinned (`pool.pin`), so a pinned block
is never evicted while its pin lives. A pool that is reset (lease lapsed, registered
again, resynced) loses its blocks with their references, so `forget_pool` drops that
pool's part of every pin instead of unpinning it.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from blockd.block import Block
from blockd.leases import PoolSlot
from blockd.prompt import Prompt
from blockd.types import NotFound, PinId, PoolId


@dataclass
class Pin:
    """The blocks one Pin call holds, per pool."""

    pin_id: PinId
    expires_at: float
    blocks: dict[PoolId, list[Block]] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.blocks.values())


class PinTable:
    def __init__(self) -> None:
        self._pins: dict[PinId, Pin] = {}

    def __iter__(self) -> Iterator[Pin]:
        return iter(list(self._pins.values()))

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, slots: Iterable[PoolSlot], prompt: Prompt, expires_at: float) -> Pin:
        """Reference the currently cached blocks of the prompt's prefix in each pool."""
        held: dict[PoolId, list[Block]] = {}
        for slot in slots:
            hits = slot.pool.match(prompt)
            if hits:
                slot.pool.pin(hits)
                held[slot.pool.pool_id] = hits
        pin_id = PinId(f"pin-{secrets.token_hex(8)}")
        assert pin_id not in self._pins, "pin id collision"
        pin = Pin(pin_id, expires_at, held)
        self._pins[pin_id] = pin
        return pin

    def unpin(self, pin_id: PinId, slots: Mapping[PoolId, PoolSlot]) -> int:
        """Drop a pin; answers how many blocks it still held."""
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            raise NotFound(f"unknown pin {pin_id!r} (it expired, was unpinned, or blockd restarted)")
        for pool_id, blocks in pin.blocks.items():
            slots[pool_id].pool.unpin(blocks)
        return pin.num_blocks

    def expired(self, now: float) -> list[PinId]:
        return [pin.pin_id for pin in self._pins.values() if pin.expires_at <= now]

    def forget_pool(self, pool_id: PoolId) -> None:
        for pin in self._pins.values():
            pin.blocks.pop(pool_id, None)
