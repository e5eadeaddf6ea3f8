"""Chained block hashes: deterministic, unambiguous, only full blocks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from blockd.hashing import BlockHasher, namespace_seed, salt_block_index, token_bytes, tokens_of
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
