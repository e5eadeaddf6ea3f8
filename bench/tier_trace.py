"""A prefix trace for the tier benchmark, and its replay through blockd's core with tiers.

Trace: conversations over Zipf-popular *families* (a long shared document or system
prompt each). A conversation re-sends its whole history every turn (family prefix,
then every earlier user message and answer, then the new message); conversations are
interleaved, so a history waits a while before its next turn, which is what eviction
decides about. Pure: no I/O, seeded.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from blockd.config import DirectoryConfig
from blockd.directory import BlockDirectory
from blockd.hashing import DEFAULT_HASHER, token_bytes
from blockd.types import AdmitOp, CommitOp, HostSpec, Namespace, ReleaseOp

BLOCK_SIZE = 16
VOCAB = 4096


@dataclass(frozen=True)
class ConversationSpec:
    num_families: int = 24
    zipf_s: float = 1.1
    family_tokens: tuple[int, int] = (256, 1024)
    num_conversations: int = 160
    turns: tuple[int, int] = (2, 8)
    user_tokens: tuple[int, int] = (24, 96)
    answer_tokens: tuple[int, int] = (32, 160)
    active: int = 12  # conversations in flight at once (interleaved turn by turn)
    seed: int = 0


def conversation_trace(spec: ConversationSpec) -> list[list[int]]:
    rng = random.Random(spec.seed)

    def tokens(bounds: tuple[int, int]) -> list[int]:
        return [rng.randrange(7, VOCAB) for _ in range(rng.randint(*bounds))]

    families = [tokens(spec.family_tokens) for _ in range(spec.num_families)]
    weights = [1 / (rank + 1) ** spec.zipf_s for rank in range(spec.num_families)]
    pending = list(range(spec.num_conversations))
    active: list[tuple[list[int], int]] = []  # (history, turns left)
    trace: list[list[int]] = []
    while pending or active:
        while pending and len(active) < spec.active:
            pending.pop()
            family = rng.choices(families, weights)[0]
            active.append((list(family), rng.randint(*spec.turns)))
        i = rng.randrange(len(active))
        history, left = active[i]
        prompt = history + tokens(spec.user_tokens)
        trace.append(prompt)
        if left > 1:
            active[i] = (prompt + tokens(spec.answer_tokens), left - 1)
        else:
            active.pop(i)
    return trace


def num_distinct_blocks(trace: Sequence[Sequence[int]], block_size: int = BLOCK_SIZE) -> int:
    seed = DEFAULT_HASHER.namespace_seed(Namespace("bench-tiers"), block_size)
    seen: set[bytes] = set()
    for prompt in trace:
        seen.update(DEFAULT_HASHER.chain(seed, token_bytes(prompt), block_size))
    return len(seen)


@dataclass(frozen=True)
class TierReplay:
    hit_tokens: int
    host_hit_tokens: int
    queried_tokens: int
    num_demotions: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def replay_tiers(
    trace: Sequence[Sequence[int]],
    num_blocks: int,
    num_host_blocks: int = 0,
    demote_min_hits: int = 0,
    policy: str = "lru",
    block_size: int = BLOCK_SIZE,
) -> TierReplay:
    """One request at a time, as computed runs it: admit (host hits come as loads),
    then commit every full block after the device hits (loads included: the copy is
    done) and release."""
    config = DirectoryConfig(eviction_policy=policy, demote_min_hits=demote_min_hits)
    directory = BlockDirectory(config, clock=lambda: 0.0)
    reg = directory.register_pool(
        num_blocks, block_size, Namespace("bench-tiers"), "sim:0", host=HostSpec(num_host_blocks)
    )
    pool, epoch = reg.pool_id, reg.epoch
    hits = host_hits = queried = 0
    for seq_id, prompt in enumerate(trace):
        result = directory.step(pool, epoch, admits=[AdmitOp(seq_id, prompt)]).admits[0]
        assert result.admitted, "one request at a time fits a pool larger than a prompt"
        first = result.num_cached_tokens // block_size - len(result.loads)
        last = len(prompt) // block_size
        commits = []
        if last > first:
            table = result.block_ids[first:last]
            commits = [CommitOp(seq_id, table, prompt[first * block_size : last * block_size])]
        directory.step(pool, epoch, commits=commits, releases=[ReleaseOp(seq_id)])
        hits += result.num_cached_tokens
        host_hits += len(result.loads) * block_size
        queried += len(prompt)
    stats = directory.stats(pool).total
    assert stats.hit_tokens == hits, "the directory's own counter must agree"
    return TierReplay(hits, host_hits, queried, stats.host.num_demotions if stats.host else 0)
