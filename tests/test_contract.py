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
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *protos],
                   cwd=REPO, check=True)
    fresh = sorted(p.name for p in (tmp_path / "kvcache/v1").iterdir())
    committed = sorted(p.name for p in (REPO / "kvcache/v1").iterdir() if p.name != "__init__.py"
                       and p.suffix in (".py", ".pyi"))
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


@pytest.mark.parametrize("package, forbidden", [
    ("blockd", {"computed", "clients", "torch"}),
    ("computed", {"blockd", "clients"}),
    ("clients", {"blockd", "computed"}),
])
def test_daemons_share_only_the_generated_contract(package, forbidden):
    for path, names in _imports(package).items():
        assert not (_top(names) & forbidden), f"{path} imports {_top(names) & forbidden}"


@pytest.mark.parametrize("module", [
    "blockd/directory.py", "blockd/pool.py", "blockd/hashing.py", "blockd/eviction.py",
    "computed/scheduler.py", "computed/sequence.py", "computed/directory_ops.py",
])
def test_pure_cores_import_no_grpc(module):
    names = _imports(str(Path(module).parent))[module]
    assert not (_top(names) & {"grpc", "kvcache", "torch", "socket", "asyncio"}), f"{module}: {names}"
