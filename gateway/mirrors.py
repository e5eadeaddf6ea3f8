"""The directory mirrors of several blockd shards, answering as one (pure: no I/O).

With shards (docs/sharding.md) every blockd process owns the pools of its own
workers, numbers its own events, and streams them on its own `WatchEvents`: one
event stream cannot describe the fleet. The gateway therefore keeps one
`DirectoryMirror` per shard, each fed by its own `MirrorFeed` (`--blockd-shard`), and
asks them as one: a worker's cached prefix is what the mirror of the shard holding
its pool says.

Invariants:
- Pools never span shards, so each worker address is known to at most one shard's
  mirror (the first that knows it answers if a misconfiguration lists it twice).
- The set answers None, as one mirror does, when it cannot answer for every worker:
  a shard's mirror out of sync, or a worker no shard's pools announce. The caller then
  asks `Route` (the fleet router, which fans out to every shard).
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.mirror import DirectoryMirror


class MirrorSet:
    """One mirror per shard; `cached_tokens` as `DirectoryMirror.cached_tokens`."""

    def __init__(self, mirrors: Sequence[DirectoryMirror]) -> None:
        assert mirrors, "a mirror set holds at least one shard's mirror"
        self.mirrors = tuple(mirrors)

    @property
    def in_sync(self) -> bool:
        return all(m.in_sync for m in self.mirrors)

    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.mirrors)

    def cached_tokens(
        self,
        addresses: Sequence[str],
        token_ids: Sequence[int],
        salt: str = "",
        public_prefix_tokens: int = 0,
    ) -> list[int] | None:
        """Per address, the prompt tokens its pool caches, from its shard's mirror; None
        when a shard's mirror is out of sync or no shard knows an address."""
        if len(self.mirrors) == 1:
            return self.mirrors[0].cached_tokens(addresses, token_ids, salt, public_prefix_tokens)
        if not self.in_sync:
            return None
        by_mirror: dict[int, list[int]] = {}  # mirror index -> positions of its addresses
        for position, address in enumerate(addresses):
            owner = next((i for i, m in enumerate(self.mirrors) if m.knows(address)), None)
            if owner is None:
                return None
            by_mirror.setdefault(owner, []).append(position)
        out = [0] * len(addresses)
        for index, positions in by_mirror.items():
            answer = self.mirrors[index].cached_tokens(
                [addresses[p] for p in positions], token_ids, salt, public_prefix_tokens
            )
            if answer is None:
                return None
            for position, tokens in zip(positions, answer):
                out[position] = tokens
        return out
