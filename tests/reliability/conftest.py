"""Fixtures of the reliability tests: the tiny model, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models import TinyModels


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return TinyModels(tmp_path_factory.mktemp("reliability_models")).get("llama")


@pytest.fixture(scope="session")
def hostile(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    """The stack the bad-input and fuzz tests attack: a short lease (so pools a fuzzer
    registers lapse quickly), a small context and a small pool (so limits are reachable)."""
    from tests.reliability.stack import start_stack, stop_stack

    stack = start_stack(
        tmp_path_factory.mktemp("hostile"),
        tiny_model,
        ["--lease-ttl", "2"],
        ["--num-blocks", "24", "--max-model-len", "128"],
    )
    yield stack
    codes = stop_stack(stack)
    assert codes == (0, 0), (codes, stack.computed.log()[-3000:], stack.blockd.log()[-3000:])


ADMIN_TOKEN = "reliability-admin-token"


@pytest.fixture(scope="session")
def guarded(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    """blockd with an admin token (every admin call of the stack's helpers sends it)."""
    from tests.reliability.stack import start_stack, stop_stack

    stack = start_stack(
        tmp_path_factory.mktemp("guarded"), tiny_model, [], ["--num-blocks", "256"], admin_token=ADMIN_TOKEN
    )
    yield stack
    assert stop_stack(stack) == (0, 0)
