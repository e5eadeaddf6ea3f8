"""The hash rule of the contract against its published vectors, and every Python
implementation in the tree against the rule: blockd's hasher (the directory's walk)
and the gateway's mirror chain. A change to any of them that moves one hash fails."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import xxhash

from blockd.hashing import DEFAULT_HASHER
from blockd.prompt import Prompt
from blockd.shared_tier import chain_of, identity_of
from blockd.types import Namespace
from gateway.prefix_hash import PromptChain
from kvcache_contract import block_hash as rule
from kvcache_contract.vectors import CASES, compute, load

VECTORS = load()


def _id(vector: dict) -> str:
    return (
        f"bs{vector['block_size']}-{len(vector['token_ids'])}tok-salt{vector['salt']!r}-pub{vector['public']}"
    )


def test_the_published_vectors_are_the_cases_the_rule_computes():
    assert [compute(case) for case in CASES] == VECTORS  # `python -m kvcache_contract.vectors --write`


def test_one_vector_from_first_principles():
    """Independent of the module: the bytes of the rule written out by hand."""
    vector = VECTORS[0]  # empty namespace fields, block size 4, tokens 0..9
    seed = xxhash.xxh3_128_digest(b"kvcache.v1/namespace" + bytes(16) + (4).to_bytes(4, "little"))
    block0 = b"".join(t.to_bytes(4, "little") for t in range(4))
    block1 = b"".join(t.to_bytes(4, "little") for t in range(4, 8))
    h0 = xxhash.xxh3_128_digest(seed + block0)
    h1 = xxhash.xxh3_128_digest(h0 + block1)
    assert vector["seed"] == seed.hex() and vector["block_hashes"] == [h0.hex(), h1.hex()]
    assert vector["token_bytes"] == b"".join(t.to_bytes(4, "little") for t in range(10)).hex()


@pytest.mark.parametrize("vector", VECTORS, ids=_id)
def test_blockd_hashes_as_the_vectors_say(vector):
    namespace = Namespace(*vector["namespace"])
    seed = DEFAULT_HASHER.namespace_seed(namespace, vector["block_size"])
    assert seed.hex() == vector["seed"]
    prompt = Prompt(bytes.fromhex(vector["token_bytes"]), vector["salt"], vector["public"])
    hashes = DEFAULT_HASHER.walk(seed, prompt.payloads(vector["block_size"]))
    assert [h.hex() for h in hashes] == vector["block_hashes"]


@pytest.mark.parametrize("vector", VECTORS, ids=_id)
def test_the_gateway_mirror_hashes_as_the_vectors_say(vector):
    seed = rule.namespace_seed(*vector["namespace"], vector["block_size"])
    data = rule.token_bytes(vector["token_ids"])
    assert data.hex() == vector["token_bytes"]
    chain = PromptChain(seed, data, vector["block_size"], vector["salt"], vector["public"])
    assert [chain.hash(i).hex() for i in range(chain.num_blocks)] == vector["block_hashes"]


@pytest.mark.parametrize("vector", VECTORS, ids=_id)
def test_blockd_chains_shared_records_as_the_vectors_say(vector):
    """The chain digests blockd writes into the shared tier's headers (`chain_of`, from
    each block's hash payload as an admission cuts it) are the published ones."""
    prompt = Prompt(bytes.fromhex(vector["token_bytes"]), vector["salt"], vector["public"])
    width = 4 * vector["block_size"]
    parent, digests = None, []
    for payload in prompt.payloads(vector["block_size"]):
        block_identity, _ = identity_of(payload, width)
        record = SimpleNamespace(chain_digest=chain_of(parent, block_identity))
        digests.append(record.chain_digest.hex())
        parent = record
    assert digests == vector["chain_digests"]


def test_one_chain_digest_from_first_principles():
    vector = VECTORS[0]  # unsalted, block size 4, tokens 0..9: two full blocks
    block0 = b"".join(t.to_bytes(4, "little") for t in range(4))
    block1 = b"".join(t.to_bytes(4, "little") for t in range(4, 8))
    d0 = hashlib.blake2b(bytes(16) + block0, digest_size=16).digest()
    d1 = hashlib.blake2b(d0 + block1, digest_size=16).digest()
    assert vector["chain_digests"] == [d0.hex(), d1.hex()]


def test_salts_ab_and_a_never_meet():
    ab, a = (v for v in VECTORS if v["block_size"] == 2 and v["salt"] in ("ab", "a"))
    assert ab["token_ids"] == a["token_ids"] and ab["block_hashes"][0] != a["block_hashes"][0]
