"""Chained block hashes: deterministic, unambiguous, only full blocks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from blockd.hashing import (
    UNSALTED_TAG,
    BlockHasher,
    block_payloads,
    namespace_seed,
    salt_block_index,
    salt_tag,
    split_blocks,
    token_bytes,
    tokens_of,
)
from blockd.types import InvalidArgument, Namespace
from tests.daemons import REPO

NS = Namespace("llama", "rev", "bfloat16", "")
TOKENS = list(range(50, 60))  # 10 tokens


def test_only_full_blocks_are_hashed_and_the_chain_carries_the_parent():
    hasher = BlockHasher()
    seed = namespace_seed(NS, 4)
    hashes = hasher.chain(seed, token_bytes(TOKENS), 4)
    assert len(hashes) == 2 and all(len(h) == 16 for h in hashes)
    other_first = hasher.chain(seed, token_bytes([0] + TOKENS[1:]), 4)
    assert other_first[1] != hashes[1]  # block 1 differs because its parent differs


def test_namespace_fields_and_block_size_change_the_seed():
    seeds = {
        namespace_seed(NS, 4),
        namespace_seed(NS, 8),
        namespace_seed(Namespace("llama", "rev2", "bfloat16"), 4),
        namespace_seed(Namespace("llama", "rev", "float32"), 4),
        namespace_seed(Namespace("llama", "rev", "bfloat16", "lora-1"), 4),
        namespace_seed(Namespace("llam", "arev", "bfloat16"), 4),
    }  # field boundaries matter
    assert len(seeds) == 6


def test_salt_is_length_prefixed_and_empty_salt_is_no_salt():
    hasher = BlockHasher()
    seed = namespace_seed(NS, 4)
    data = token_bytes(TOKENS)
    assert hasher.chain(seed, data, 4, "ab") != hasher.chain(seed, data, 4, "a")
    assert hasher.chain(seed, data, 4, "") == hasher.chain(seed, data, 4)
    # salt scope: blocks before the salted block are the unsalted ones
    public = hasher.chain(seed, data, 4, "s", public_prefix_tokens=4)
    assert public[0] == hasher.chain(seed, data, 4)[0] and public[1] != hasher.chain(seed, data, 4)[1]


@pytest.mark.parametrize(
    "salt, public, block_size, expected",
    [
        ("", 0, 4, None),
        ("s", 0, 4, 0),
        ("s", 3, 4, 0),
        ("s", 4, 4, 1),
        ("s", 9, 4, 2),
    ],
)
def test_salt_block_index(salt, public, block_size, expected):
    assert salt_block_index(salt, public, block_size) == expected


def test_hashes_are_the_same_in_another_process():
    code = (
        "from blockd.hashing import *; from blockd.types import Namespace; "
        "ns = Namespace('llama', 'rev', 'bfloat16', ''); "
        "seed = namespace_seed(ns, 4); "
        "print(repr(BlockHasher().chain(seed, token_bytes(list(range(50, 60))), 4, 'x')))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed), "PATH": ""},
        ).stdout
        for seed in (1, 2)
    }
    here = repr(BlockHasher().chain(namespace_seed(NS, 4), token_bytes(TOKENS), 4, "x"))
    assert outputs == {here + "\n"}


def test_token_bytes_round_trip_and_range():
    assert tokens_of(token_bytes([0, 1, 2**32 - 1])) == (0, 1, 2**32 - 1)
    assert token_bytes([1]) == b"\x01\x00\x00\x00"  # little-endian on every platform
    for bad in ([-1], [2**32], ["a"]):
        with pytest.raises(InvalidArgument):
            token_bytes(bad)


# Hashes of the first implementation (per-block slices, one digest per block): a
# faster walk must keep every value, or caches and event mirrors would disagree.
GOLDEN_SEED = "46af63e8be0d06854f072fa02310a945"
GOLDEN_CHAINS = {
    ("", 0): [
        "6d9e63d0b8d65c74aafe4236d282a443",
        "5772128f4a86273ba000950f540bd845",
        "668b1b2fbab95dd370794d9e4b4e3e66",
    ],
    ("tenant", 0): [
        "51d2c15eeab0f42ffc10d04b42bb3ef1",
        "0c5c777b83b976751b7a2ae5c4fbedb9",
        "e1ace3201c75af9e0e6cae47b6965c56",
    ],
    ("tenant", 5): [
        "6d9e63d0b8d65c74aafe4236d282a443",
        "ea5e02b8802dd1635373e61938864cf7",
        "d0d867e739855bd16660c205d9dc7adc",
    ],
}


@pytest.mark.parametrize("salt, public", list(GOLDEN_CHAINS))
def test_hash_values_are_those_of_the_first_implementation(salt, public):
    seed = namespace_seed(NS, 4)
    assert seed.hex() == GOLDEN_SEED
    data = token_bytes(list(range(50, 62)) + [7])  # 3 full blocks and a tail
    assert [h.hex() for h in BlockHasher().chain(seed, data, 4, salt, public)] == GOLDEN_CHAINS[salt, public]


def test_walk_is_the_chain_rule_and_stops_at_the_first_miss():
    hasher = BlockHasher()
    seed = namespace_seed(NS, 4)
    blocks = split_blocks(token_bytes(list(range(50, 62))), 4)
    hashes = hasher.walk(seed, blocks)
    assert hashes == hasher.chain(seed, token_bytes(list(range(50, 62))), 4)
    assert hashes[1] == hasher.block_hash(hashes[0], UNSALTED_TAG, blocks[1])
    looked_up: list[bytes] = []

    def lookup(block_hash: bytes) -> str | None:
        looked_up.append(block_hash)
        return "hit" if block_hash == hashes[0] else None

    assert hasher.walk(seed, blocks, lookup) == ["hit"]
    assert looked_up == hashes[:2]  # the hit and the one miss; block 2 is never hashed


def test_payloads_put_the_salt_tag_in_one_block_only():
    blocks = split_blocks(token_bytes(list(range(12))), 4)
    assert block_payloads(blocks, "", None) is blocks
    assert block_payloads(blocks, "s", 5) is blocks  # the salted block is past this run
    salted = block_payloads(blocks, "s", 1)
    assert salted[0] is blocks[0] and salted[2] is blocks[2]
    assert salted[1] == salt_tag("s") + blocks[1]


def test_split_blocks_keeps_zero_bytes_and_drops_the_tail():
    data = token_bytes([0, 0, 0, 0, 1, 0, 0, 0, 5])
    assert split_blocks(data, 4) == [bytes(16), token_bytes([1, 0, 0, 0])]
