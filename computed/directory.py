"""What the engine needs from blockd: the `Directory` protocol.

The engine talks to blockd only through this protocol. The daemon plugs in the gRPC
`DirectoryClient` (computed/directory_client.py); tests plug in an in-process adapter
over blockd's pure core (tests/computed/inprocess_directory.py), so the engine runs
against the real directory logic without a network. No gRPC here.

Contract every implementation keeps:
- `step` sends one batched Step; any failure of blockd (down, restarted, stale epoch,
  lease lapsed) raises `computed.errors.DirectoryUnavailable`, sets `needs_recovery`
  and changes nothing else the engine can see.
- `needs_recovery` is the one recovery flag: set by a failed step or when the
  directory noticed on its own (a failed lease renewal) that blockd lost this pool;
  only `recover` clears it.
- `recover` (re-)registers the pool and re-declares `sequences` with a Resync; it
  retries until blockd answers, or until `stopping` is set.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from computed.directory_ops import DirectoryOps, DirectoryResult, ResyncSequence


class LeaseInfo(Protocol):
    """The part of a granted lease others may read."""

    @property
    def pool_id(self) -> str: ...


class Directory(Protocol):
    @property
    def lease(self) -> LeaseInfo | None:
        """The current lease; None until the first registration."""
        ...

    @property
    def needs_recovery(self) -> bool: ...

    async def step(self, ops: DirectoryOps, /) -> DirectoryResult: ...

    async def recover(
        self, sequences: list[ResyncSequence], stopping: asyncio.Event | None = None, /
    ) -> None: ...

    async def renew_forever(self, wake: asyncio.Event, /) -> None:
        """Keep the lease alive; set `needs_recovery` and `wake` when blockd lost it."""
        ...

    async def close(self) -> None: ...
