"""The core modules split out of the directory stay pure: no gRPC, no I/O."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.daemons import REPO

PURE = (
    "allocator",
    "block",
    "directory",
    "events",
    "eviction",
    "hashing",
    "leases",
    "pins",
    "pool",
    "prompt",
    "queries",
    "routing",
    "types",
    "validation",
)
FORBIDDEN = {"grpc", "kvcache", "torch", "socket", "asyncio", "structlog"}


def _top_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("module", PURE)
def test_core_module_imports_no_grpc_or_io(module):
    names = _top_imports(REPO / "blockd" / f"{module}.py")
    assert not names & FORBIDDEN, f"blockd/{module}.py imports {names & FORBIDDEN}"


@pytest.mark.parametrize("path", sorted((REPO / "blockd" / "tiers").glob("*.py")), ids=lambda p: p.name)
def test_tier_modules_are_pure(path):
    """Tiers are core: no gRPC, no I/O (the worker moves the bytes; blockd only decides)."""
    names = _top_imports(path)
    assert not names & (FORBIDDEN | {"redis", "valkey"}), (
        f"blockd/tiers/{path.name} imports {names & FORBIDDEN}"
    )
