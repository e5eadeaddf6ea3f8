"""Routing policies: which of a model's available workers gets a request. Pure (no I/O).

Every policy sees the same facts about each candidate worker, in configuration order:
the prompt tokens it already caches (blockd's Route, 0 when not asked) and the load
this gateway has sent it (requests in flight, and how many of their prompt tokens are
still waiting for prefill). It answers the index of its pick. Policies are chosen by
name from `POLICIES` (`--routing`).

The cost model of `cache-aware` counts work in prefill tokens, the unit a worker's step
budget is spent in: a request's time to first token is about the prefill queued on its
worker ahead of it, plus the steps shared with requests already decoding there, plus
its own uncached tokens. Cached tokens are only worth as much as the queue they do not
make it wait behind, so a hot prefix spills to a second worker once the first one's
queue costs more than the prefix saves, and stays put while it does not.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Candidate:
    """One available worker, as routing sees it."""

    cached_tokens: int  # of this prompt, in the worker's pool (blockd's Route; 0 when unrouted)
    num_inflight: int  # requests this gateway has in flight there
    num_waiting: int = 0  # of those, the ones without a first token yet
    queued_prefill_tokens: int = 0  # their uncached prompt tokens (where known)


class RoutingPolicy(Protocol):
    # Whether the policy weighs cached prefixes (the prompt is tokenized and Route asked).
    uses_cache: bool

    def pick(self, prompt_tokens: int, candidates: Sequence[Candidate]) -> int:
        """Index into `candidates` (never empty) of the worker to send the request to."""
        ...


class RoundRobin:
    """Each worker in turn, whatever it caches or carries (the benchmark's baseline)."""

    uses_cache = False

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, prompt_tokens: int, candidates: Sequence[Candidate]) -> int:
        return next(self._turn) % len(candidates)


class LeastLoaded:
    """Fewest requests in flight; the first listed among equals."""

    uses_cache = False

    def pick(self, prompt_tokens: int, candidates: Sequence[Candidate]) -> int:
        return min(range(len(candidates)), key=lambda i: candidates[i].num_inflight)


class LongestPrefix:
    """Most cached tokens, then fewest in flight: cache affinity whatever the queue (a hot
    prefix family piles onto one worker; kept to compare against)."""

    uses_cache = True

    def pick(self, prompt_tokens: int, candidates: Sequence[Candidate]) -> int:
        return min(
            range(len(candidates)),
            key=lambda i: (-candidates[i].cached_tokens, candidates[i].num_inflight),
        )


@dataclass(frozen=True)
class CacheAware:
    """Least estimated work before the first token: queued prefill + decoding requests ×
    `decode_cost_tokens` + this prompt's uncached tokens; more cached, then fewer in
    flight, then the first listed among equals."""

    # What one request decoding on a worker costs a newcomer there, in prefill tokens. A
    # continuous batch does not make the newcomer wait for it to finish: it adds its one
    # token (and its attention over its context) to each step they share, and a newcomer
    # whose prefill fits a step shares one or two. A queued prefill is paid in full.
    decode_cost_tokens: int = 4
    uses_cache = True

    def cost(self, prompt_tokens: int, candidate: Candidate) -> int:
        decoding = max(0, candidate.num_inflight - candidate.num_waiting)
        uncached = max(0, prompt_tokens - candidate.cached_tokens)
        return candidate.queued_prefill_tokens + decoding * self.decode_cost_tokens + uncached

    def pick(self, prompt_tokens: int, candidates: Sequence[Candidate]) -> int:
        return min(
            range(len(candidates)),
            key=lambda i: (
                self.cost(prompt_tokens, candidates[i]),
                -candidates[i].cached_tokens,
                candidates[i].num_inflight,
            ),
        )


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "cache-aware": CacheAware,
    "prefix": LongestPrefix,
    "least-loaded": LeastLoaded,
    "round-robin": RoundRobin,
}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {name!r}")
    return POLICIES[name]()
