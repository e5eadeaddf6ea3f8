"""The gateway is a client of the daemons: it imports the contract and clients/, never a daemon."""

from __future__ import annotations

import ast

from tests.daemons import REPO

FORBIDDEN = ("blockd", "computed", "tests", "bench")
# no I/O: validation, mapping, policies, the directory mirror and its hashing
PURE = ("schema", "errors", "responses", "tenants", "config", "routing", "mirror", "mirrors", "prefix_hash")


def _imports(path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_gateway_imports_no_daemon() -> None:
    for path in sorted((REPO / "gateway").glob("*.py")):
        bad = [n for n in _imports(path) if n.split(".")[0] in FORBIDDEN]
        assert not bad, f"{path.name} imports {bad}"


def test_pure_modules_do_no_io() -> None:
    io = ("grpc.aio", "fastapi", "uvicorn", "asyncio", "socket", "gateway.fleet", "gateway.app")
    for name in PURE:
        imported = _imports(REPO / "gateway" / f"{name}.py")
        assert not [n for n in imported if n.startswith(io)], f"gateway/{name}.py does I/O"


def test_routing_cores_import_no_grpc_and_no_contract() -> None:
    """The policies and the directory mirror are plain data structures: no gRPC, no generated code."""
    for name in ("routing", "mirror", "mirrors", "prefix_hash"):
        imported = _imports(REPO / "gateway" / f"{name}.py")
        assert not [n for n in imported if n.split(".")[0] in ("grpc", "kvcache")], f"gateway/{name}.py"
