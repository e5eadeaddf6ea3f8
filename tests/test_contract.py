"""The contract and the layering: generated code is fresh, imports flow one way."""

from __future__ import annotations

import ast
import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_generated_code_matches_proto(tmp_path):
    protos = sorted(str(p.relative_to(REPO)) for p in (REPO / "proto/kvcache/v1").glob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iproto",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *protos,
        ],
        cwd=REPO,
        check=True,
    )
    fresh = sorted(p.name for p in (tmp_path / "kvcache/v1").iterdir())
    committed = sorted(
        p.name
        for p in (REPO / "kvcache/v1").iterdir()
        if p.name != "__init__.py" and p.suffix in (".py", ".pyi")
    )
    assert fresh == committed, "run `make proto`: generated files differ from proto/"
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "kvcache/v1", REPO / "kvcache/v1", fresh, shallow=False)
    assert not mismatch and not errors, f"stale generated code {mismatch or errors}: run `make proto`"


def _imports(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (REPO / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(REPO))] = names
    return found


def _top(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


@pytest.mark.parametrize(
    "package, forbidden",
    [
        ("blockd", {"computed", "clients", "torch"}),
        ("computed", {"blockd", "clients"}),
        ("clients", {"blockd", "computed"}),
    ],
)
def test_daemons_share_only_the_generated_contract(package, forbidden):
    for path, names in _imports(package).items():
        assert not (_top(names) & forbidden), f"{path} imports {_top(names) & forbidden}"


@pytest.mark.parametrize(
    "module",
    [
        "blockd/directory.py",
        "blockd/pool.py",
        "blockd/hashing.py",
        "blockd/eviction.py",
        "computed/scheduler.py",
        "computed/sequence.py",
        "computed/directory_ops.py",
        "computed/request_policy.py",
    ],
)
def test_pure_cores_import_no_grpc(module):
    names = _imports(str(Path(module).parent))[module]
    assert not (_top(names) & {"grpc", "kvcache", "torch", "socket", "asyncio"}), f"{module}: {names}"


@pytest.mark.parametrize("module", ["computed/engine.py", "computed/directory.py"])
def test_engine_knows_blockd_only_through_the_directory_protocol(module):
    names = _imports("computed")[module]
    assert not (_top(names) & {"grpc", "kvcache"}), f"{module}: {names}"
    assert "computed.directory_client" not in names, f"{module} imports the gRPC directory client"


# Helpers each daemon keeps its own copy of (they may not import each other): the
# copies must stay equal, or a fix in one daemon silently misses the other.
MIRRORED_FILES = [("blockd/logs.py", "computed/logs.py")]
MIRRORED_DEFINITIONS = [
    (
        "blockd/service.py",
        "computed/service.py",
        ["Malformed", "_status_of", "_details", "_abort", "unary", "streaming", "add_service", "_lenient"],
    ),
    ("blockd/server.py", "computed/server.py", ["_write_atomically"]),
]


def _definitions(path: str) -> dict[str, str]:
    """Top-level functions and classes of `path`, each as its exact source text."""
    text = (REPO / path).read_text()
    lines = text.splitlines(keepends=True)
    found: dict[str, str] = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            found[node.name] = "".join(lines[first - 1 : node.end_lineno])
    return found


@pytest.mark.parametrize("original, copy", MIRRORED_FILES)
def test_mirrored_files_are_identical(original, copy):
    assert (REPO / original).read_bytes() == (REPO / copy).read_bytes(), (
        f"{copy} drifted from {original}: make them byte-identical again"
    )


@pytest.mark.parametrize("original, copy, names", MIRRORED_DEFINITIONS)
def test_mirrored_definitions_are_identical(original, copy, names):
    ours, theirs = _definitions(original), _definitions(copy)
    for name in names:
        assert name in ours and name in theirs, f"{name} missing from {original} or {copy}"
        assert ours[name] == theirs[name], f"{copy}:{name} drifted from {original}:{name}"
