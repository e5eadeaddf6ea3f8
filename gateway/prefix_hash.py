"""Chained block hashes of a prompt, exactly as blockd computes them (pure: no I/O).

The directory mirror (`gateway.mirror`) finds a prompt's cached prefix by hashing its
full blocks the way blockd does and looking the hashes up in the sets blockd's event
stream fills. The rule (DESIGN.md "Hashing and namespaces"):

    h_{-1} = H("kvcache.v1/namespace" | len-prefixed model_id, revision, dtype, adapter | block_size)
    h_i    = H(h_{i-1} | salt_tag_i | tokens of block i as uint32 little-endian)

The rule is the contract's (`kvcache_contract.block_hash`, with its published test
vectors); this module imports it and adds only the lazy, batched walk the mirror needs.

Invariants: only full blocks are hashed (the partial tail never is); hashes are
computed lazily, left to right, each at most once per `PromptChain`.
"""

from __future__ import annotations

import numpy as np

from kvcache_contract.block_hash import digest as _digest
from kvcache_contract.block_hash import namespace_seed, salt_tag, token_bytes

__all__ = ["PromptChain", "namespace_seed", "salt_tag", "token_bytes"]

_FIRST_BATCH = 4  # blocks hashed at the first `hash()`: a new prompt misses at block 0
_SPLIT_WITH_NUMPY_FROM = 8  # blocks; below, plain slices are faster


class PromptChain:
    """The block hashes of one prompt under one namespace seed and block size, computed
    on demand and each once: `hash(i)` hashes the blocks up to i, in batches that double
    (at least `_FIRST_BATCH`), so a walk that ends at its first uncached block hashes at
    most about twice the blocks it needed, and a long cached prefix is hashed in a few
    tight loops: the mirror's answer for a cached 4,096-token prompt took ~240 us instead of
    ~380 us hashed one block per call (`python -m bench.gateway`, "mirror answer" rows)."""

    __slots__ = ("_data", "_hashes", "_salt_index", "_salt_tag", "_width", "num_blocks")

    def __init__(
        self, seed: bytes, data: bytes, block_size: int, salt: str = "", public_prefix_tokens: int = 0
    ) -> None:
        self._data = data  # token_bytes of the prompt
        self._width = 4 * block_size
        self.num_blocks = len(data) // self._width
        self._salt_index = public_prefix_tokens // block_size if salt else -1
        self._salt_tag = salt_tag(salt) if salt else b""
        self._hashes: list[bytes] = [seed]  # h_{-1}, h_0, ...

    def hash(self, index: int) -> bytes:
        """h_index (0 <= index < num_blocks)."""
        if index + 1 >= len(self._hashes):
            self._extend(max(index + 1, 2 * (len(self._hashes) - 1), _FIRST_BATCH))
        return self._hashes[index + 1]

    def _extend(self, count: int) -> None:
        """Hash blocks up to `count` (at most num_blocks)."""
        hashes, width = self._hashes, self._width
        start, stop = len(hashes) - 1, min(count, self.num_blocks)
        if stop - start >= _SPLIT_WITH_NUMPY_FROM:  # one numpy call cuts every block
            data = self._data[start * width : stop * width]
            blocks = np.frombuffer(data, dtype=f"V{width}", count=stop - start).tolist()
        else:
            blocks = [self._data[i * width : (i + 1) * width] for i in range(start, stop)]
        if start <= self._salt_index < stop:
            blocks[self._salt_index - start] = self._salt_tag + blocks[self._salt_index - start]
        parent, append, digest = hashes[-1], hashes.append, _digest
        for block in blocks:
            parent = digest(parent + block)
            append(parent)
