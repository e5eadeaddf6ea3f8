"""The chunks of many requests on one `GenerateMany` stream, taken together by its writer.

Why: a message per request per engine step costs the worker ~70-90 us of gRPC send CPU
and the gateway ~50-60 us to receive (profiled under `python -m bench --only serving`,
32 streams in flight), as much as the step's own host work. One message per step for
every request on the stream pays that once.

Invariants:
- A key's items come out in the order they were put; `take` returns every item put since
  the last `take`, keys in order of first appearance.
- `sink(key).empty()` is true once the writer took the key's items: the engine's turn
  between steps (Engine._serve_between_steps) waits on it as it waits on a request's queue.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

Item = TypeVar("Item")


class Outbox(Generic[Item]):
    def __init__(self) -> None:
        self._pending: dict[int, list[Item]] = {}
        self._ready = asyncio.Event()

    def put(self, key: int, item: Item) -> None:
        items = self._pending.get(key)
        if items is None:
            self._pending[key] = [item]
        else:
            items.append(item)
        self._ready.set()

    def sink(self, key: int) -> KeySink[Item]:
        """What a request's producer feeds, in place of an `asyncio.Queue`."""
        return KeySink(self, key)

    def wake(self) -> None:
        """Wake the writer with nothing new (e.g. the stream's reader ended)."""
        self._ready.set()

    async def wait(self) -> None:
        """Until something was put (or `wake`) since the last `take`."""
        await self._ready.wait()

    def take(self) -> dict[int, list[Item]]:
        pending, self._pending = self._pending, {}
        self._ready.clear()
        return pending

    def holds(self, key: int) -> bool:
        return key in self._pending

    def holds_any(self) -> bool:
        return bool(self._pending)


class KeySink(Generic[Item]):
    """One key's side of an Outbox, shaped like the queue the engine feeds."""

    __slots__ = ("_key", "_outbox")

    def __init__(self, outbox: Outbox[Item], key: int) -> None:
        self._outbox = outbox
        self._key = key

    def put_nowait(self, item: Item) -> None:
        self._outbox.put(self._key, item)

    def empty(self) -> bool:
        return not self._outbox.holds(self._key)
