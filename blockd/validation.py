"""Every check of client input, in one place, before anything changes.

Identities and limits (pool ids, registration, pages, pins, salts, token lists) are
checked field by field; a Step or Resync is checked as a whole. A step's ops are
checked together, simulating the order they will be applied in (commits, releases,
grows, admits): a release frees its sequence id for an admit of the same step, a
grow cannot reach a sequence released before it, and so on. Any bad input raises a
`DirectoryError` whose message says what to fix, and nothing has changed; an op that
passes can only fail for lack of free blocks, which is a per-op result, not an error.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from blockd.config import MAX_BLOCK_SIZE, MAX_POOL_BLOCKS, DirectoryConfig
from blockd.eviction import DEFAULT_RETENTION, MAX_RETENTION
from blockd.hashing import TOKEN_BYTES, block_width, token_bytes
from blockd.pool import BlockPool, ResyncPlan
from blockd.prompt import Prompt
from blockd.types import (
    NO_HOST_TIER,
    AdmitOp,
    BlockId,
    CachePolicy,
    CommitOp,
    GrowOp,
    HostSpec,
    InvalidArgument,
    Namespace,
    NotFound,
    PoolId,
    ReleaseOp,
    ResourceExhausted,
    ResyncSequence,
    SequenceId,
)

MAX_NAME_CHARS = 256
MAX_SALT_BYTES = 1024
MAX_PIN_TTL_SECONDS = 30 * 86_400
DEFAULT_PIN_TTL_SECONDS = 3_600.0
DEFAULT_PAGE_SIZE = 1_000
MAX_PAGE_SIZE = 10_000
_POOL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")

# ---------------------------------------------------------------- pools


def check_registration(
    num_blocks: int,
    block_size: int,
    namespace: Namespace,
    worker_address: str,
    pool_id: PoolId | None,
    pool_token: str | None = None,
    host: HostSpec = NO_HOST_TIER,
) -> None:
    if not 1 <= num_blocks <= MAX_POOL_BLOCKS:
        raise InvalidArgument(f"num_blocks must be 1 .. {MAX_POOL_BLOCKS}, got {num_blocks}")
    if not 0 <= host.num_blocks <= MAX_POOL_BLOCKS:
        raise InvalidArgument(
            f"num_host_blocks must be 0 (no host tier) .. {MAX_POOL_BLOCKS}, got {host.num_blocks}"
        )
    for name, cost in (
        ("host_load_seconds_per_block", host.load_seconds_per_block),
        ("prefill_seconds_per_token", host.prefill_seconds_per_token),
        ("shared_load_seconds_per_block", host.shared_load_seconds_per_block),
    ):
        if not (math.isfinite(cost) and cost >= 0.0):
            raise InvalidArgument(f"{name} must be a finite number >= 0 (0: unknown), got {cost}")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise InvalidArgument(f"block_size must be 1 .. {MAX_BLOCK_SIZE}, got {block_size}")
    for name, value in (
        ("namespace.model_id", namespace.model_id),
        ("namespace.model_revision", namespace.model_revision),
        ("namespace.dtype", namespace.dtype),
        ("namespace.adapter_id", namespace.adapter_id),
        ("worker_address", worker_address),
        ("pool_token", pool_token or ""),
    ):
        if len(value) > MAX_NAME_CHARS:
            raise InvalidArgument(f"{name} is longer than {MAX_NAME_CHARS} characters")
    if pool_id is not None and not _POOL_ID.fullmatch(pool_id):
        raise InvalidArgument(
            f"pool_id {shown(pool_id)} must be 1-128 characters of A-Z a-z 0-9 . _ : - "
            f"starting with a letter or digit (or empty to get a new id)"
        )


def check_pool_id_given(pool_id: PoolId) -> None:
    if not pool_id:
        raise InvalidArgument("pool_id is empty: call RegisterPool first and pass its pool_id")


def shown(pool_id: str) -> str:
    """A client-sent id as it appears in messages: never long enough to drown them."""
    return repr(pool_id) if len(pool_id) <= 64 else f"{pool_id[:32]!r}... ({len(pool_id)} characters)"


# ---------------------------------------------------------------- prompts


def make_prompt(
    token_ids: Seq[int],
    cache_salt: str,
    public_prefix_tokens: int,
    max_tokens: int,
    what: str,
    packed: bytes = b"",
) -> Prompt:
    """Validate a client's tokens (a list, or `packed` uint32 LE bytes); `what` names
    them in error messages."""
    data = packed_tokens(token_ids, packed, what)
    num_tokens = len(data) // TOKEN_BYTES
    if not num_tokens:
        raise InvalidArgument(f"{what}: token_ids is empty; send at least one token")
    if num_tokens > max_tokens:
        raise InvalidArgument(
            f"{what}: {num_tokens} tokens exceed the limit of {max_tokens} "
            f"per sequence (blockd --max-sequence-tokens)"
        )
    check_salt(cache_salt, what)
    if public_prefix_tokens < 0:
        raise InvalidArgument(f"{what}: public_prefix_tokens must be >= 0, got {public_prefix_tokens}")
    return Prompt(data, cache_salt, public_prefix_tokens)


def packed_tokens(token_ids: Seq[int], packed: bytes, what: str) -> bytes:
    """The tokens as uint32 LE bytes, from whichever field carried them. Packed bytes
    are taken as they are (no conversion: the cheap path of a busy worker)."""
    if packed:
        if len(token_ids):
            raise InvalidArgument(f"{what}: send the tokens in token_ids or in token_bytes, not both")
        if len(packed) % TOKEN_BYTES:
            raise InvalidArgument(
                f"{what}: token_bytes holds {len(packed)} bytes, not a multiple of {TOKEN_BYTES} "
                f"(each token id is 4 bytes, unsigned little-endian)"
            )
        return bytes(packed)
    return token_bytes(token_ids)


def check_salt(cache_salt: str, what: str) -> None:
    if len(cache_salt.encode("utf-8")) > MAX_SALT_BYTES:
        raise InvalidArgument(f"{what}: cache_salt is longer than {MAX_SALT_BYTES} bytes")


# ---------------------------------------------------------------- operators


def checked_pin_ttl(ttl_seconds: float) -> float:
    """The pin's lifetime: 0 means the default (one hour), at most 30 days."""
    if ttl_seconds == 0:
        return DEFAULT_PIN_TTL_SECONDS
    if not (math.isfinite(ttl_seconds) and 0 < ttl_seconds <= MAX_PIN_TTL_SECONDS):
        raise InvalidArgument(
            f"ttl_seconds must be in (0, {MAX_PIN_TTL_SECONDS}] (0 means "
            f"{DEFAULT_PIN_TTL_SECONDS:.0f}), got {ttl_seconds}"
        )
    return ttl_seconds


def checked_page_size(size: int) -> int:
    """Blocks per ListBlocks page: 0 means the default."""
    if size == 0:
        return DEFAULT_PAGE_SIZE
    if not 1 <= size <= MAX_PAGE_SIZE:
        raise InvalidArgument(f"page_size must be 1 .. {MAX_PAGE_SIZE} (or 0 for {DEFAULT_PAGE_SIZE})")
    return size


def encode_page_token(pool_id: PoolId, block_id: int) -> str:
    """Where the next page starts: after this (pool id, block id)."""
    return base64.urlsafe_b64encode(json.dumps([pool_id, block_id]).encode()).decode()


def decode_page_token(token: str) -> tuple[str, int]:
    try:
        pool_id, block_id = json.loads(base64.urlsafe_b64decode(token.encode()))
        if isinstance(pool_id, str) and isinstance(block_id, int):
            return pool_id, block_id
    except (ValueError, TypeError, binascii.Error):
        pass
    raise InvalidArgument("page_token is not one this server issued; pass the previous next_page_token")


# ---------------------------------------------------------------- steps and resyncs


@dataclass(frozen=True, slots=True)
class StepPlan:
    commits: list[tuple[SequenceId, list[BlockId], bytes]]
    releases: list[SequenceId]
    grows: list[tuple[SequenceId, int]]
    admits: list[tuple[SequenceId, Prompt, CachePolicy, int]]


def plan_step(
    pool: BlockPool,
    config: DirectoryConfig,
    commits: Seq[CommitOp],
    releases: Seq[ReleaseOp],
    grows: Seq[GrowOp],
    admits: Seq[AdmitOp],
) -> StepPlan:
    released: set[SequenceId] = set()
    next_commit: dict[SequenceId, int] = {}
    plan = StepPlan([], [], [], [])
    for commit in commits:
        plan.commits.append(_plan_commit(pool, commit, next_commit))
    for release in releases:
        if release.sequence_id not in pool.sequences or release.sequence_id in released:
            raise NotFound(
                f"release: sequence {release.sequence_id} is not live in pool {pool.pool_id!r} "
                f"(released already, or never admitted)"
            )
        released.add(release.sequence_id)
        plan.releases.append(release.sequence_id)
    for grow in grows:
        if grow.sequence_id not in pool.sequences or grow.sequence_id in released:
            raise NotFound(f"grow: sequence {grow.sequence_id} is not live in pool {pool.pool_id!r}")
        _check_num_tokens(pool, config, grow.num_tokens, f"grow of sequence {grow.sequence_id}")
        plan.grows.append((grow.sequence_id, grow.num_tokens))
    admitted: set[SequenceId] = set()
    for op in admits:
        sequence_id = op.sequence_id
        if (sequence_id in pool.sequences and sequence_id not in released) or sequence_id in admitted:
            raise InvalidArgument(
                f"admit: sequence id {sequence_id} is already live in pool {pool.pool_id!r}; "
                f"ids must be unique among live sequences"
            )
        admitted.add(sequence_id)
        what = f"admit of sequence {sequence_id}"
        prompt = make_prompt(
            op.token_ids,
            op.cache_salt,
            op.public_prefix_tokens,
            config.max_sequence_tokens,
            what,
            op.token_bytes,
        )
        _check_num_tokens(pool, config, prompt.num_tokens, what)
        check_retention_priority(op.retention_priority, what)
        plan.admits.append((sequence_id, prompt, op.cache_policy, op.retention_priority))
    return plan


def check_retention_priority(priority: int, what: str) -> None:
    if not 0 <= priority <= MAX_RETENTION:
        raise InvalidArgument(
            f"{what}: retention_priority must be 1 .. {MAX_RETENTION} (0: the default "
            f"{DEFAULT_RETENTION}), got {priority}"
        )


def plan_resync(pool: BlockPool, config: DirectoryConfig, sequences: Seq[ResyncSequence]) -> list[ResyncPlan]:
    """Check that the declared sequences fit the (empty) pool: ids in range, unique
    sequence ids, enough blocks for the tokens, and a block held by several sequences
    only as the same full block (same position, parent block, tokens and salt)."""
    plans: list[ResyncPlan] = []
    seen_sequences: set[SequenceId] = set()
    # block id -> (sequence id, identity of the full block, or None for a partial one)
    holders: dict[int, tuple[SequenceId, tuple | None]] = {}
    for seq in sequences:
        what = f"resync of sequence {seq.sequence_id}"
        if seq.sequence_id in seen_sequences:
            raise InvalidArgument(f"{what}: sequence id declared twice")
        seen_sequences.add(seq.sequence_id)
        prompt = make_prompt(
            seq.token_ids, seq.cache_salt, seq.public_prefix_tokens, config.max_sequence_tokens, what
        )
        block_ids: list[BlockId] = list(seq.block_ids)  # type: ignore[arg-type]
        if len(block_ids) < pool.num_blocks_for(prompt.num_tokens):
            raise InvalidArgument(
                f"{what}: {len(block_ids)} blocks cannot hold {prompt.num_tokens} tokens "
                f"of {pool.block_size} per block"
            )
        if len(set(block_ids)) != len(block_ids):
            raise InvalidArgument(f"{what}: a block id appears twice in its table")
        payloads = prompt.payloads(pool.block_size)  # tokens and salt of each full block
        for i, block_id in enumerate(block_ids):
            if not 0 <= block_id < pool.num_blocks:
                raise InvalidArgument(
                    f"{what}: block id {block_id} is outside the pool (0 .. {pool.num_blocks - 1})"
                )
            identity = None
            if i < len(payloads):
                identity = (i, block_ids[i - 1] if i else None, payloads[i])
            other = holders.get(block_id)
            if other is not None and (identity is None or other[1] != identity):
                raise InvalidArgument(
                    f"{what}: block {block_id} is also held by sequence {other[0]}; "
                    f"only identical full blocks of a shared prefix may be shared"
                )
            holders[block_id] = (seq.sequence_id, identity)
        plans.append(ResyncPlan(seq.sequence_id, block_ids, prompt))
    return plans


def _plan_commit(
    pool: BlockPool, op: CommitOp, next_commit: dict[SequenceId, int]
) -> tuple[SequenceId, list[BlockId], bytes]:
    what = f"commit of sequence {op.sequence_id}"
    sequence = pool.sequences.get(op.sequence_id)
    if sequence is None:
        raise NotFound(f"{what}: the sequence is not live in pool {pool.pool_id!r}")
    block_ids: list[BlockId] = list(op.block_ids)  # type: ignore[arg-type]
    table = sequence.block_ids
    start = next_commit.get(op.sequence_id, sequence.num_committed)
    run = table[start : start + len(block_ids)]
    if block_ids != run:  # a run of the table has no foreign block
        foreign = set(block_ids).difference(table)
        if foreign:
            raise InvalidArgument(
                f"{what}: foreign block(s) {sorted(foreign)[:8]} are not in the sequence's block table"
            )
        first = f"block {table[start]}" if start < len(table) else "none: every block is committed"
        raise InvalidArgument(
            f"{what}: block_ids must be the run of the table from its first "
            f"uncommitted block (index {start}, {first}); got {block_ids[:8]}"
        )
    width = block_width(pool.block_size)
    known = sequence.token_bytes
    offset = start * width
    if not (len(op.token_ids) or op.token_bytes):  # by block index: the tokens blockd holds
        data = known[offset : offset + len(block_ids) * width]
        if len(data) != len(block_ids) * width:
            raise InvalidArgument(
                f"{what}: no tokens sent, and blockd holds tokens up to token "
                f"{len(known) // TOKEN_BYTES} only (the prompt): send the token_ids of blocks "
                f"past it (blocks {start} .. {start + len(block_ids) - 1} of the table)"
            )
        next_commit[op.sequence_id] = start + len(block_ids)
        return op.sequence_id, run, data
    data = packed_tokens(op.token_ids, op.token_bytes, what)
    if len(data) != len(block_ids) * width:
        raise InvalidArgument(
            f"{what}: partial block: {len(block_ids)} blocks need exactly "
            f"{len(block_ids) * pool.block_size} tokens, got {len(data) // TOKEN_BYTES}"
        )
    overlap = max(0, min(len(data), len(known) - offset))
    if data[:overlap] != known[offset : offset + overlap]:
        raise InvalidArgument(
            f"{what}: tokens differ from the sequence's prompt where they overlap "
            f"(from token {start * pool.block_size})"
        )
    next_commit[op.sequence_id] = start + len(block_ids)
    # the table's own ids (equal to the op's): the pool's check of the run then compares
    # each id with itself, which a list comparison answers by identity
    return op.sequence_id, run, data


def _check_num_tokens(pool: BlockPool, config: DirectoryConfig, num_tokens: int, what: str) -> None:
    if not 0 <= num_tokens <= config.max_sequence_tokens:
        raise InvalidArgument(
            f"{what}: {num_tokens} tokens is outside 0 .. {config.max_sequence_tokens} "
            f"(blockd --max-sequence-tokens)"
        )
    needed = pool.num_blocks_for(num_tokens)
    if needed > pool.num_blocks:
        raise ResourceExhausted(
            f"{what}: {num_tokens} tokens need {needed} blocks of {pool.block_size} "
            f"tokens but pool {pool.pool_id!r} has only {pool.num_blocks} blocks"
        )
