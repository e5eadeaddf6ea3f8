"""The best an eviction rule can do from what blockd sees of a block's origin, its settings
chosen with hindsight: an upper estimate for online policies of that kind (issue 44).

What blockd knows when a sequence releases its blocks, besides recency: how many of the
prompt's blocks were cached at admission (the hit prefix) and how many it computed (the
fresh run, `Block.run_length`). A rule here sorts every request into three classes by
those two numbers and gives each a horizon, as `adaptive-ungated`'s run classes do:

- a *fresh start* (hit prefix <= `prefix_cut` blocks, run <= `run_cut`): a conversation's
  opening or a short one-shot request, which the trace cannot tell apart;
- a *long fresh run* (hit prefix <= `prefix_cut`, run > `run_cut`): pasted documents;
- a *continuation* (hit prefix > `prefix_cut`): a later turn over a cached history.

Every block of a released chain takes `release tick + horizon[class]`; the smallest goes
first, leaves only (as blockd and `bench.belady`), so a chain is eaten tail first. The
horizons and cuts are searched over a grid *on the trace being scored* (hindsight no
online policy has), so the best cell bounds what an online policy that ranks by recency
and these two numbers can reach. It is not a bound on every online policy: one that saw
more (a session id, a client's hint) could do better, as the class oracle shows — the
same rule with each request's true kind (`bench.retention_traces`' family ids: one-shot,
a session's first request, a later one) in place of the two numbers.

    .venv/bin/python -m bench.hindsight_rules [--full]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.belady import ReplayResult
from bench.prefix_keys import PrefixKeys

# rank(request index, hit blocks, fresh full blocks) -> the priority of the chain it releases
Rank = Callable[[int, int, int], float]
NEVER_KEEP = -1e18  # a horizon that puts a class before every other


def replay_ranked(
    trace: Sequence[Sequence[int]], num_blocks: int, block_size: int, rank: Rank
) -> ReplayResult:
    """One request at a time: its longest cached prefix of full blocks hits, the rest of the
    prompt gets blocks (evicting the lowest-ranked unprotected leaves), its full blocks are
    cached, and its whole chain is re-ranked at release."""
    keys = PrefixKeys(block_size)
    parent_of: dict[int, int] = {}
    cached: set[int] = set()
    children: dict[int, int] = {}
    priority: dict[int, float] = {}
    heap: list[tuple[float, int]] = []  # (priority, key) of leaves; lazy
    hit_tokens = queried = evictions = 0
    hits_of: list[int] = []
    for t, prompt in enumerate(trace):
        chain = keys.chain(prompt)
        for i, key in enumerate(chain):
            parent_of.setdefault(key, chain[i - 1] if i else -1)
        num_hits = 0
        while num_hits < len(chain) and chain[num_hits] in cached:
            num_hits += 1
        protected = set(chain[:num_hits])
        need = keys.num_blocks(len(prompt)) - num_hits
        assert keys.num_blocks(len(prompt)) <= num_blocks, "a prompt larger than the pool"
        set_aside = []
        while num_blocks - len(cached) < need:
            entry = heapq.heappop(heap)
            stamp, key = entry
            if key not in cached or children.get(key, 0) or priority[key] != stamp:
                continue  # stale entry
            if key in protected:
                set_aside.append(entry)
                continue
            cached.discard(key)
            evictions += 1
            parent = parent_of[key]
            if parent >= 0:
                children[parent] -= 1
                if not children[parent] and parent in cached:
                    heapq.heappush(heap, (priority[parent], parent))
        for entry in set_aside:
            heapq.heappush(heap, entry)
        for key in chain[num_hits:]:
            cached.add(key)
            parent = parent_of[key]
            if parent >= 0:
                children[parent] = children.get(parent, 0) + 1
        stamp = rank(t, num_hits, len(chain) - num_hits)
        for key in chain:
            priority[key] = stamp
            if not children.get(key, 0):
                heapq.heappush(heap, (stamp, key))
        hit_tokens += num_hits * block_size
        hits_of.append(num_hits * block_size)
        queried += len(prompt)
    return ReplayResult(hit_tokens, queried, evictions, tuple(hits_of))


@dataclass(frozen=True)
class Rule:
    prefix_cut: int  # hit blocks at most this: a fresh start or a long fresh run
    run_cut: int  # fresh blocks at most this: a fresh start
    fresh_start: float  # horizons, in requests
    long_run: float
    continuation: float

    def rank(self, t: int, num_hits: int, num_fresh: int) -> float:
        if num_hits > self.prefix_cut:
            return t + self.continuation
        return t + (self.fresh_start if num_fresh <= self.run_cut else self.long_run)


def grid(full: bool) -> list[Rule]:
    """The rules searched: `full`, 288 (4 prefix cuts x 4 run cuts x 3 x 2 x 3 horizons);
    else the neighbourhood of the full grid's best on the conversation trace at 2%."""
    if full:
        axes = ((4, 8, 16, 32), (16, 32, 64, 128), (200, 1000, 1e9), (NEVER_KEEP, 0), (-100, 0, 100))
    else:
        axes = ((8, 16), (64,), (200, 1000), (NEVER_KEEP,), (-100, 0))
    return [Rule(*values) for values in itertools.product(*axes)]


def best_rule(
    trace: Sequence[Sequence[int]], num_blocks: int, block_size: int, rules: list[Rule]
) -> tuple[Rule, ReplayResult]:
    scored = [(rule, replay_ranked(trace, num_blocks, block_size, rule.rank)) for rule in rules]
    return max(scored, key=lambda pair: pair[1].hit_tokens)


def class_oracle(family_ids: Sequence[int], fresh_start: float = 1e9) -> Rank:
    """The rule with each request's true kind: one-shots (family -1) first, a session's
    first request kept over everything else, later ones by recency."""
    first: list[bool] = []
    seen: set[int] = set()
    for family in family_ids:
        first.append(family >= 0 and family not in seen)
        seen.add(family)

    def rank(t: int, num_hits: int, num_fresh: int) -> float:
        if family_ids[t] < 0:
            return t + NEVER_KEEP
        return t + (fresh_start if first[t] else 0.0)

    return rank


def main() -> None:
    from bench.eviction_quality import BLOCK_SIZE
    from bench.retention_traces import conversation_spec, distinct_blocks, make_session_trace

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="search all 288 rules (minutes)")
    parser.add_argument("--share", type=float, default=0.02, help="the pool, a share of distinct blocks")
    args = parser.parse_args()
    trace = make_session_trace(conversation_spec(4_000))
    num_blocks = int(distinct_blocks(trace.prompts, BLOCK_SIZE) * args.share)
    lru = replay_ranked(trace.prompts, num_blocks, BLOCK_SIZE, lambda t, h, n: t)
    rule, best = best_rule(trace.prompts, num_blocks, BLOCK_SIZE, grid(args.full))
    oracle = replay_ranked(trace.prompts, num_blocks, BLOCK_SIZE, class_oracle(trace.family_ids))
    print(f"conversation trace, pool {num_blocks} blocks ({args.share:.0%}), hit tokens ÷ lru:")
    print(
        f"  best rule on hit prefix + fresh run, chosen with hindsight: {best.hit_tokens / lru.hit_tokens:.3f} ({rule})"
    )
    print(f"  class oracle (each request's true kind): {oracle.hit_tokens / lru.hit_tokens:.3f}")


if __name__ == "__main__":
    main()
