"""A tiny simulated worker over the pure directory, to keep tests short."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from blockd import native
from blockd.config import DirectoryConfig
from blockd.directory import BlockDirectory
from blockd.hashing import DEFAULT_HASHER, BlockHasher
from blockd.types import NO_HOST_TIER, AdmitOp, AdmitResult, CommitOp, HostSpec, Namespace, ReleaseOp
from tests.blockd.invariants import FakeClock, attributes, check_invariants

__all__ = ["attributes", "patches_blockd"]

# A test that replaces a method of a blockd class or instance to observe or steer it: the
# compiled core (BLOCKD_NATIVE=on, blockd.native) does not allow that, and the pure run of
# `make test` covers it.
patches_blockd = pytest.mark.skipif(
    native.is_enabled(), reason="replaces a method, which blockd's compiled classes do not allow"
)

NAMESPACE = Namespace("test-model", "rev-1", "float32", "")


@dataclass
class Harness:
    directory: BlockDirectory
    clock: FakeClock
    pool_id: str
    epoch: int
    block_size: int
    pool_token: str = ""  # the owner's: re-registering the live pool needs it
    tables: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def pool(self):
        return self.directory._slots[self.pool_id].pool

    def step(self, **ops):
        result = self.directory.step(self.pool_id, self.epoch, **ops)
        check_invariants(self.directory)
        return result

    def admit(self, sequence_id: int, tokens: list[int], salt: str = "", public: int = 0) -> AdmitResult:
        result = self.step(admits=[AdmitOp(sequence_id, tokens, salt, public)]).admits[0]
        if result.admitted:
            self.tables[sequence_id] = result.block_ids
        return result

    def commit_full(self, sequence_id: int, tokens: list[int], num_cached_tokens: int = 0) -> None:
        """Commit every full block of `tokens` after the cached ones (a finished prefill)."""
        bs = self.block_size
        first, last = num_cached_tokens // bs, len(tokens) // bs
        table = self.tables[sequence_id]
        if last > first:
            self.step(commits=[CommitOp(sequence_id, table[first:last], tokens[first * bs : last * bs])])

    def release(self, sequence_id: int) -> None:
        self.step(releases=[ReleaseOp(sequence_id)])
        self.tables.pop(sequence_id, None)

    def run(self, sequence_id: int, tokens: list[int], salt: str = "", public: int = 0) -> AdmitResult:
        """Admit, write and commit the prompt's full blocks, release: the prompt is cached."""
        result = self.admit(sequence_id, tokens, salt, public)
        assert result.admitted
        self.commit_full(sequence_id, tokens, result.num_cached_tokens)
        self.release(sequence_id)
        return result


def harness(
    num_blocks: int = 16,
    block_size: int = 4,
    hasher: BlockHasher = DEFAULT_HASHER,
    host: HostSpec = NO_HOST_TIER,
    **config,
) -> Harness:
    clock = FakeClock()
    directory = BlockDirectory(DirectoryConfig(**config), clock=clock, hasher=hasher)
    reg = directory.register_pool(num_blocks, block_size, NAMESPACE, "worker-0:50052", host=host)
    return Harness(directory, clock, reg.pool_id, reg.epoch, block_size, reg.pool_token)
