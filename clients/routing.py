"""Choosing which computed serves a request: cache-aware (ask blockd) or round robin.

Pure policy, no I/O: the clients fetch the token ids and blockd's Route answer and
ask these objects which known worker to use.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from clients.types import Route

ROUTING_MODES = ("cache-aware", "round-robin")

_LOOPBACK_NAMES = {"localhost": "127.0.0.1", "[::1]": "127.0.0.1", "ip6-localhost": "127.0.0.1"}


def normalize_address(address: str) -> str:
    """host:port with loopback names folded together and a dns:/// or ipv4: prefix removed."""
    for prefix in ("dns:///", "ipv4:", "ipv6:"):
        address = address.removeprefix(prefix)
    host, sep, port = address.rpartition(":")
    if not sep:
        return address
    return f"{_LOOPBACK_NAMES.get(host.lower(), host)}:{port}"


def validate_mode(mode: str) -> str:
    if mode not in ROUTING_MODES:
        raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, got {mode!r}")
    return mode


class RoundRobin:
    """Cycles through a fixed, non-empty list of addresses; safe to share between threads."""

    def __init__(self, addresses: Sequence[str]) -> None:
        if not addresses:
            raise ValueError("need at least one computed address")
        self._addresses = tuple(addresses)
        self._next = 0
        self._lock = threading.Lock()

    @property
    def addresses(self) -> tuple[str, ...]:
        return self._addresses

    def next(self) -> str:
        with self._lock:
            address = self._addresses[self._next % len(self._addresses)]
            self._next += 1
            return address


def choose_routed(route: Route, addresses: Sequence[str]) -> str | None:
    """The first worker in blockd's ranking that this client knows, as the client spells it.

    blockd ranks every live pool (longest cached prefix first, load breaking ties).
    Its addresses are those the workers registered; a worker this client was not
    given (another tenant's, or one only reachable inside a container network) is
    skipped. None when no known worker is ranked.
    """
    known = {normalize_address(a): a for a in addresses}
    ranked = [route.worker_address] if route.worker_address else []
    ranked += [c.worker_address for c in route.candidates]
    for worker in ranked:
        mine = known.get(normalize_address(worker)) if worker else None
        if mine is not None:
            return mine
    return None
