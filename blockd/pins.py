"""Pins: references an operator holds on a cached prefix until a deadline."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from blockd.block import Block
from blockd.types import PinId, PoolId


@dataclass
class Pin:
    """The blocks one Pin call holds, per pool. A pool that is reset (lease lapsed,
    registered again, resynced) loses its blocks, so its entry is dropped."""

    pin_id: PinId
    expires_at: float
    blocks: dict[PoolId, list[Block]] = field(default_factory=dict)


class PinTable:
    def __init__(self) -> None:
        self._pins: dict[PinId, Pin] = {}

    def __iter__(self):
        return iter(list(self._pins.values()))

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, expires_at: float, blocks: dict[PoolId, list[Block]]) -> Pin:
        pin_id = PinId(f"pin-{secrets.token_hex(8)}")
        assert pin_id not in self._pins, "pin id collision"
        pin = Pin(pin_id, expires_at, blocks)
        self._pins[pin_id] = pin
        return pin

    def pop(self, pin_id: PinId) -> Pin | None:
        return self._pins.pop(pin_id, None)

    def expired(self, now: float) -> list[Pin]:
        return [pin for pin in self._pins.values() if pin.expires_at <= now]

    def forget_pool(self, pool_id: PoolId) -> None:
        for pin in self._pins.values():
            pin.blocks.pop(pool_id, None)
