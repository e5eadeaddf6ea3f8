"""kvctl's diagnosis of addresses and failures, without daemons (the swap check runs live in test_kvctl)."""

from __future__ import annotations

import grpc
import pytest

from clients.diagnose import check_address, explain_unimplemented, in_kvctl_words
from clients.errors import KVCacheError


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:50051",
        "localhost:1",
        "[::1]:50051",
        "unix:/tmp/b.sock",
        "dns:///blockd.internal:50051",
        "ipv4:10.0.0.1:7",
    ],
)
def test_host_port_and_grpc_targets_pass(address: str) -> None:
    assert check_address(address, "blockd") == address


@pytest.mark.parametrize(
    ("address", "service", "words"),
    [
        ("127.0.0.1", "blockd", ["has no port", "127.0.0.1:50051", "default port is 50051"]),
        ("localhost", "computed", ["has no port", "localhost:50052"]),
        ("::1", "blockd", ["has no port"]),
        ("127.0.0.1:", "blockd", ["has no port"]),
        ("http://127.0.0.1:50051", "blockd", ["is a URL", "without http://", "e.g. 127.0.0.1:50051"]),
        ("https://gpu-box:9000/", "computed", ["is a URL", "e.g. gpu-box:9000", "--tls-ca"]),
        ("grpc://gpu-box", "computed", ["is a URL", "e.g. gpu-box:50052"]),
        ("127.0.0.1:http", "blockd", ["not a number from 1 to 65535"]),
        ("127.0.0.1:70000", "blockd", ["not a number from 1 to 65535"]),
        ("  ", "blockd", ["is empty"]),
    ],
)
def test_what_looks_wrong_is_said(address: str, service: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as error:
        check_address(address, service)
    for word in words:
        assert word in str(error.value)


def test_rpc_names_become_kvctl_commands() -> None:
    text = "unknown pool 'p'; ListPools shows the known ones (internal error in GetStats)"
    assert (
        in_kvctl_words(text) == "unknown pool 'p'; `kvctl pools` shows the known ones (internal error in "
        "`kvctl stats`)"
    )
    assert in_kvctl_words("ListPoolsX and Listpools stay") == "ListPoolsX and Listpools stay"


def test_only_unimplemented_is_checked_for_a_swap() -> None:
    refused = KVCacheError("blockd", "127.0.0.1:1", grpc.StatusCode.NOT_FOUND, "no")
    assert explain_unimplemented(refused, None) is None


def test_unimplemented_alone_names_the_likely_swap() -> None:
    error = KVCacheError("blockd", "127.0.0.1:50052", grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
    assert str(error).startswith("blockd at 127.0.0.1:50052 does not serve this blockd call (UNIMPLEMENTED)")
    assert "computed's address" in str(error)
