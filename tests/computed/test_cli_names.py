"""computed's names: the served model name clients use, and the address a worker announces."""

from __future__ import annotations

import socket
from pathlib import Path

from clients.client import ComputedClient
from computed.__main__ import announced_address, parse_args
from tests.daemons import start_blockd, start_computed


def test_a_wildcard_host_is_announced_as_this_hosts_address() -> None:
    here = socket.gethostbyname(socket.gethostname())
    assert announced_address(None, "0.0.0.0:50052") == f"{here}:50052"  # scaled from one template
    assert announced_address("0.0.0.0:7000", "127.0.0.1:50052") == f"{here}:7000"
    assert announced_address("computed-0.computed:50052", "0.0.0.0:50052") == "computed-0.computed:50052"
    assert announced_address(None, "127.0.0.1:50052") is None  # the bound address, as before
    assert announced_address(None, "0.0.0.0:0") is None  # a free port: the bound address, after binding
    assert announced_address(None, "unix:/tmp/c.sock") is None


def test_the_served_model_name_is_what_clients_name(tmp_path: Path) -> None:
    assert parse_args(["--served-model-name", "acme/chat"]).served_model_name == "acme/chat"
    blockd = start_blockd(tmp_path, "--log-format", "json")
    try:
        worker = start_computed(
            tmp_path, blockd.address, "--served-model-name", "acme/chat", "--log-format", "json"
        )
        try:
            with ComputedClient(worker.address) as client:
                assert client.model_info().model_id == "acme/chat"
        finally:
            worker.stop()
    finally:
        blockd.stop()
