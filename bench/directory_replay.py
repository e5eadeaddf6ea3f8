"""Replay a trace through the real blockd directory core (no gRPC), one request at a time.

Each request is one `step` that admits it, then one that commits every full block it
computed and releases it, as computed does for a finished request.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.belady import ReplayResult
from blockd.config import DirectoryConfig
from blockd.directory import BlockDirectory
from blockd.types import AdmitOp, CachePolicy, CommitOp, Namespace, ReleaseOp


def replay_directory(
    trace: Sequence[Sequence[int]],
    num_blocks: int,
    block_size: int,
    policy: str = "lru",
    commit_limits: Sequence[int] | None = None,
    read_only: Sequence[bool] | None = None,
) -> ReplayResult:
    """`commit_limits[i]`: commit only request i's blocks within its first that many tokens
    (a diagnostic: what the policy would do if unique suffixes were never cached).
    `read_only[i]`: request i is sent with cache_policy READ_ONLY (its hits are used,
    its new blocks are never indexed), as a client that knows it is a one-off would."""
    directory = BlockDirectory(DirectoryConfig(eviction_policy=policy), clock=lambda: 0.0)
    reg = directory.register_pool(num_blocks, block_size, Namespace("bench-eviction"), "sim:0")
    pool, epoch = reg.pool_id, reg.epoch
    hit_tokens = queried = 0
    hits_of: list[int] = []
    for seq_id, prompt in enumerate(trace):
        cache_policy = (
            CachePolicy.READ_ONLY if read_only is not None and read_only[seq_id] else CachePolicy.STORE
        )
        admit = AdmitOp(seq_id, prompt, cache_policy=cache_policy)
        result = directory.step(pool, epoch, admits=[admit]).admits[0]
        assert result.admitted, "one request at a time always fits a pool larger than a prompt"
        first = result.num_cached_tokens // block_size
        limit = len(prompt) if commit_limits is None else min(len(prompt), commit_limits[seq_id])
        last = max(first, limit // block_size)
        commits = [
            CommitOp(seq_id, result.block_ids[first:last], prompt[first * block_size : last * block_size])
        ]
        directory.step(pool, epoch, commits=commits if last > first else [], releases=[ReleaseOp(seq_id)])
        hit_tokens += result.num_cached_tokens
        hits_of.append(result.num_cached_tokens)
        queried += len(prompt)
    stats = directory.stats(pool).total
    assert stats.hit_tokens == hit_tokens, "the directory's own counter must agree"
    return ReplayResult(hit_tokens, queried, stats.num_evictions, tuple(hits_of))
