"""The published test vectors of the block hash rule (`block_hash_vectors.json`).

    python -m kvcache_contract.vectors --write   # regenerate after a deliberate rule change

Each vector gives the inputs (namespace fields, block size, token ids, salt, public
prefix) and the outputs an implementation must reproduce: the packed token bytes
(the `token_bytes` wire fields), h_{-1} and every full block's hash, all in hex; and the
chain digest of every full block, which the shared tier's value headers carry
(`shared_value.chain_digest`, SharedBlock.chain_digest).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvcache_contract.block_hash import block_hashes, namespace_seed, token_bytes
from kvcache_contract.shared_value import chain_digests

VECTORS_FILE = Path(__file__).with_name("block_hash_vectors.json")

CASES = [
    {"namespace": ["", "", "", ""], "block_size": 4, "token_ids": list(range(10)), "salt": "", "public": 0},
    {
        "namespace": ["Qwen/Qwen3-0.6B", "main", "bfloat16", ""],
        "block_size": 16,
        "token_ids": [151643, 0, 1, 4294967295] * 10,
        "salt": "",
        "public": 0,
    },
    {
        "namespace": ["m", "r1", "float32", ""],
        "block_size": 4,
        "token_ids": list(range(100, 112)),
        "salt": "tenant-a",
        "public": 0,
    },
    {
        "namespace": ["m", "r1", "float32", "lora-7"],
        "block_size": 4,
        "token_ids": list(range(100, 117)),
        "salt": "ü-tenant",
        "public": 6,
    },
    {"namespace": ["m", "", "", ""], "block_size": 2, "token_ids": [1, 2, 3, 4], "salt": "ab", "public": 0},
    {"namespace": ["m", "", "", ""], "block_size": 2, "token_ids": [1, 2, 3, 4], "salt": "a", "public": 0},
]


def compute(case: dict) -> dict:
    data = token_bytes(case["token_ids"])
    seed = namespace_seed(*case["namespace"], case["block_size"])
    hashes = block_hashes(seed, data, case["block_size"], case["salt"], case["public"])
    return {
        **case,
        "token_bytes": data.hex(),
        "seed": seed.hex(),
        "block_hashes": [h.hex() for h in hashes],
        "chain_digests": [
            d.hex() for d in chain_digests(data, case["block_size"], case["salt"], case["public"])
        ],
    }


def load() -> list[dict]:
    return json.loads(VECTORS_FILE.read_text())["vectors"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {VECTORS_FILE.name}")
    args = parser.parse_args()
    document = {
        "rule": "kvcache_contract/block_hash.py (DESIGN.md: Hashing and namespaces)",
        "fields": {
            "namespace": "model_id, model_revision, dtype, adapter_id",
            "public": "public_prefix_tokens",
            "token_bytes": "token ids as uint32 little-endian, hex",
            "seed": "h_{-1}, hex",
            "block_hashes": "h_0 .. h_{n-1} of the full blocks, hex",
            "chain_digests": "the shared tier's chain digest of each full block, hex "
            "(kvcache_contract/shared_value.py)",
        },
        "vectors": [compute(case) for case in CASES],
    }
    text = json.dumps(document, indent=1, ensure_ascii=False) + "\n"
    if args.write:
        VECTORS_FILE.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
