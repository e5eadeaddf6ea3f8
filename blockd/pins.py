"""Pins: references an operator holds on a cached prefix until a deadline.

A pin holds one reference on each block it pinned (`pool.pin`), so a pinned block
is never evicted while its pin lives. Pinned blocks of a pool may not pass its pin
budget (a share of its blocks), so pins can never starve the requests; a pin of a
prompt with nothing cached is refused (it would hold nothing). A pool that is reset (lease lapsed, registered
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
from blockd.types import NotFound, PinId, PoolId, ResourceExhausted


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

    def pin(self, slots: Iterable[PoolSlot], prompt: Prompt, expires_at: float, budget: float = 1.0) -> Pin:
        """Reference the currently cached blocks of the prompt's prefix in each pool.
        Checked first, for every pool: no pool passes `budget` × its blocks pinned
        (ResourceExhausted); then applied. A prompt cached nowhere gets a pin holding
        nothing (0 tokens, as the contract has always answered): clients say so."""
        slots = list(slots)
        held: dict[PoolId, list[Block]] = {}
        for slot in slots:
            pool = slot.pool
            hits = pool.match(prompt)
            if not hits:
                continue
            limit = int(budget * pool.num_blocks)
            pinned = pool.num_pinned + sum(1 for block in hits if not block.pin_count)
            if pinned > limit:
                raise ResourceExhausted(
                    f"pin: pool {pool.pool_id!r} would have {pinned} of its {pool.num_blocks} blocks "
                    f"pinned, past its pin budget of {limit} ({budget:.0%}); unpin something "
                    f"(kvctl unpin PIN_ID, or --all) or pin a shorter prefix"
                )
            held[pool.pool_id] = hits
        for slot in slots:
            if slot.pool.pool_id in held:
                slot.pool.pin(held[slot.pool.pool_id])
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

    def ids(self) -> list[PinId]:
        return list(self._pins)

    def expired(self, now: float) -> list[PinId]:
        return [pin.pin_id for pin in self._pins.values() if pin.expires_at <= now]

    def forget_pool(self, pool_id: PoolId) -> None:
        for pin in self._pins.values():
            pin.blocks.pop(pool_id, None)
