"""A token list with its salt (validated by `validation.make_prompt`): the key of every cache walk."""

from __future__ import annotations

from dataclasses import dataclass, field

from blockd.hashing import TOKEN_BYTES, block_payloads, block_width, salt_block_index, split_blocks


@dataclass(frozen=True, slots=True)
class Prompt:
    """Tokens as uint32 little-endian bytes (converted once, cut into blocks once per
    block size: a Lookup or Route walks the same prompt in every pool)."""

    token_bytes: bytes
    salt: str = ""  # empty: no salt
    public_prefix_tokens: int = 0
    _payloads: dict[int, list[bytes]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_bytes) // TOKEN_BYTES

    def salt_block(self, block_size: int) -> int | None:
        return salt_block_index(self.salt, self.public_prefix_tokens, block_size)

    def blocks(self, block_size: int) -> list[bytes]:
        """The tokens of each full block (the partial tail has none)."""
        return split_blocks(self.token_bytes, block_size)

    def payloads(self, block_size: int, limit: int | None = None) -> list[bytes]:
        """What each full block's hash covers after its parent's (`hashing.block_payloads`);
        with `limit`, of the first `limit` blocks only (not kept)."""
        if limit is not None:
            head = self.token_bytes[: limit * block_width(block_size)]
            return block_payloads(split_blocks(head, block_size), self.salt, self.salt_block(block_size))
        payloads = self._payloads.get(block_size)
        if payloads is None:
            payloads = block_payloads(self.blocks(block_size), self.salt, self.salt_block(block_size))
            self._payloads[block_size] = payloads
        return payloads
