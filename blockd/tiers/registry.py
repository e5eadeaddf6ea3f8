"""Which lower tiers a pool has, in the order an admission walks them.

A tier is one module (a `LowerTier` and a factory) plus one entry here: its name, its
rank (faster first: the device pool is rank 0) and its factory, which answers the
tier for a pool's `TierSetup`, or None when the pool's worker does not have it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from blockd.tiers.base import LowerTier, TierSetup
from blockd.tiers.host import make_host_level
from blockd.tiers.shared import make_shared_level


@dataclass(frozen=True, slots=True)
class TierEntry:
    name: str
    rank: float  # walk order: lower is faster, walked first
    build: Callable[[TierSetup], LowerTier | None]


TIERS: dict[str, TierEntry] = {
    "host": TierEntry("host", 1.0, make_host_level),
    "shared": TierEntry("shared", 2.0, make_shared_level),
}


def make_lower_tiers(setup: TierSetup) -> list[LowerTier]:
    """The pool's lower tiers, faster first (every registered tier the worker has)."""
    tiers = []
    for entry in sorted(TIERS.values(), key=lambda e: e.rank):
        tier = entry.build(setup)
        if tier is not None:
            tiers.append(tier)
    return tiers
