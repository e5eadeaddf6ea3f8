"""Forced hash collisions: a colliding block is a miss, never someone else's K/V.

Daemon level: blockd's real server and directory with a weak hasher injected (see
collide_blockd.py; blockd has no flag or environment hook for it), driven by a real
computed; greedy outputs must equal the cold (nothing cached) outputs. Core level: a
random workload over BlockDirectory with weak digests, every hit checked against the
exact prefix each block was committed with.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from blockd.config import DirectoryConfig
from blockd.directory import BlockDirectory
from blockd.hashing import BlockHasher
from blockd.types import AdmitOp, CommitOp, Namespace, ReleaseOp
from tests.daemons import spawn, start_computed
from tests.reliability.collide_blockd import weak_digest
from tests.reliability.stack import BLOCK, Stack, assert_accounting, stop_stack, tokens


@pytest.fixture(
    scope="module", params=[0, pytest.param(1, marks=pytest.mark.slow)], ids=["all-collide", "1-byte"]
)
def colliding(request, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    workdir = tmp_path_factory.mktemp("collide")
    blockd = spawn(
        "blockd", "tests.reliability.collide_blockd", workdir, [], env={"COLLIDE_BYTES": str(request.param)}
    )
    try:
        computed = start_computed(
            workdir, blockd.address, "--block-size", str(BLOCK), "--num-blocks", "128", model=tiny_model
        )
    except BaseException:
        blockd.kill()
        raise
    stack = Stack(blockd, computed, tiny_model)
    yield stack
    assert stop_stack(stack) == (0, 0)


def cold(stack: Stack, prompt: list[int], n: int = 6) -> list[int]:
    """The output with nothing cached (the index is flushed first)."""
    stack.wait_idle()
    stack.flush()
    result = stack.generate(prompt, n)
    assert result.usage.cached_tokens == 0
    return result.token_ids


@pytest.mark.parametrize("colliding", [0], indirect=True, ids=["all-collide"])
def test_every_hash_colliding_costs_misses_not_correctness(colliding: Stack) -> None:
    a = tokens(900, 3 * BLOCK + 2)
    b = tokens(901, 3 * BLOCK + 2)
    c = a[:BLOCK] + tokens(902, 2 * BLOCK + 1)  # shares A's first block
    d = a[:BLOCK] * 2 + tokens(903, 3)  # A's first block twice: same tokens, hash, other parent
    reference = {name: cold(colliding, p) for name, p in (("a", a), ("b", b), ("c", c), ("d", d))}
    colliding.wait_idle()
    colliding.flush()
    # Only the first committed block can be indexed (every later hash is taken), so:
    expected = [("a", a, 0), ("a", a, BLOCK), ("b", b, 0), ("c", c, BLOCK), ("d", d, BLOCK), ("b", b, 0)]
    for name, prompt, cached in expected:
        result = colliding.generate(prompt, 6)
        assert result.token_ids == reference[name], f"{name}: a collision changed the output"
        assert result.usage.cached_tokens == cached, (name, result.usage)
    idle = colliding.wait_idle()
    assert idle.num_referenced_blocks == 0 and idle.num_cached_blocks == 1
    assert_accounting(idle)


def test_colliding_concurrent_workload_matches_cold_outputs(colliding: Stack) -> None:
    rng = random.Random(5)
    roots = [tokens(910 + i, 4 * BLOCK) for i in range(3)]
    prompts = [
        rng.choice(roots)[: rng.randint(1, 4 * BLOCK)] + tokens(920 + i, rng.randint(1, 9)) for i in range(16)
    ]
    reference = [cold(colliding, p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        for _ in range(2):  # the second pass finds whatever the first one managed to index
            outputs = list(pool.map(lambda p: colliding.generate(p, 6).token_ids, prompts))
            assert outputs == reference
    idle = colliding.wait_idle()
    assert idle.num_referenced_blocks == 0
    assert_accounting(idle)


# ---------------------------------------------------------------- directory core


def identity(prompt: list[int], salt: str, public: int, i: int) -> tuple:
    """What block i of a prompt holds: its whole prefix, and the salt scope when the salt
    is mixed into it or an earlier block (blocks before the scope are shared by all)."""
    salt_block = public // BLOCK if salt else None
    scope = (salt, salt_block) if salt_block is not None and i >= salt_block else None
    return tuple(prompt[: (i + 1) * BLOCK]), scope


def run_checked_workload(hasher: BlockHasher, seed: int, num_admissions: int = 400) -> int:
    """Admit, commit and release random prompts with shared prefixes, salts and public
    scopes; assert each hit holds exactly the prefix (and salt scope) it was committed
    with. Answers the number of cached tokens served."""
    directory = BlockDirectory(DirectoryConfig(), hasher=hasher)
    reg = directory.register_pool(40, BLOCK, Namespace("collide"))
    rng = random.Random(seed)
    roots = [tokens(seed * 100 + i, 6 * BLOCK) for i in range(4)]
    # block id -> identity of what its K/V holds: (prefix tokens, salt scope)
    written: dict[int, tuple] = {}
    served = 0
    for seq_id in range(num_admissions):
        prompt = rng.choice(roots)[: rng.randint(0, 6 * BLOCK)] + tokens(rng.random(), rng.randint(1, 6))
        salt, public = rng.choice(["", "", "x", "y"]), rng.choice([0, 0, BLOCK, 2 * BLOCK + 1])
        result = directory.step(
            reg.pool_id, reg.epoch, admits=[AdmitOp(seq_id, prompt, salt, public)]
        ).admits[0]
        assert result.admitted
        hits = result.num_cached_tokens // BLOCK
        for i in range(hits):
            assert written[result.block_ids[i]] == identity(prompt, salt, public, i), (
                f"hit {i} of sequence {seq_id} is foreign K/V"
            )
        served += result.num_cached_tokens
        full = len(prompt) // BLOCK
        commit = CommitOp(seq_id, result.block_ids[hits:full], prompt[hits * BLOCK : full * BLOCK])
        directory.step(reg.pool_id, reg.epoch, commits=[commit], releases=[ReleaseOp(seq_id)])
        for i in range(hits, full):
            written[result.block_ids[i]] = identity(prompt, salt, public, i)
        stats = directory.stats().total
        assert stats.num_referenced_blocks == 0
        assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_blocks
    return served


@pytest.mark.parametrize("kept_bytes", [0, 1])
def test_weak_hashes_cost_misses_never_foreign_blocks(kept_bytes: int) -> None:
    inputs: dict[bytes, set[bytes]] = {}
    digest = weak_digest(kept_bytes)

    def recording(data: bytes) -> bytes:
        out = digest(data)
        inputs.setdefault(out, set()).add(data)
        return out

    served = run_checked_workload(BlockHasher(recording), seed=kept_bytes + 1)
    collisions = sum(len(v) - 1 for v in inputs.values())
    assert collisions > 100, f"the workload was meant to collide, got {collisions}"
    assert served > 0, "verified hits must still be served"
