"""A validated token list with its salt: the key of every cache walk."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from blockd.hashing import TOKEN_BYTES, block_payloads, salt_block_index, split_blocks, token_bytes
from blockd.types import InvalidArgument

MAX_SALT_BYTES = 1024


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

    def payloads(self, block_size: int) -> list[bytes]:
        """What each full block's hash covers after its parent's (`hashing.block_payloads`)."""
        payloads = self._payloads.get(block_size)
        if payloads is None:
            payloads = block_payloads(self.blocks(block_size), self.salt, self.salt_block(block_size))
            self._payloads[block_size] = payloads
        return payloads


def make_prompt(
    token_ids: Sequence[int], cache_salt: str, public_prefix_tokens: int, max_tokens: int, what: str
) -> Prompt:
    """Validate a client's token list; `what` names it in error messages."""
    if not token_ids:
        raise InvalidArgument(f"{what}: token_ids is empty; send at least one token")
    if len(token_ids) > max_tokens:
        raise InvalidArgument(
            f"{what}: {len(token_ids)} tokens exceed the limit of {max_tokens} "
            f"per sequence (blockd --max-sequence-tokens)"
        )
    check_salt(cache_salt, what)
    if public_prefix_tokens < 0:
        raise InvalidArgument(f"{what}: public_prefix_tokens must be >= 0, got {public_prefix_tokens}")
    return Prompt(token_bytes(token_ids), cache_salt, public_prefix_tokens)


def check_salt(cache_salt: str, what: str) -> None:
    if len(cache_salt.encode("utf-8")) > MAX_SALT_BYTES:
        raise InvalidArgument(f"{what}: cache_salt is longer than {MAX_SALT_BYTES} bytes")
