"""The README and docs/ say only what the code does: every flag, environment variable and
default their tables quote is the programs' own (`--help`), every kvctl option they name
exists, every `make` target they print is the Makefile's, every link resolves, and the
README stays a five-minute read."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemons import REPO

README = REPO / "README.md"
# docs/openai.md and docs/sharding.md are written by others; the rest are checked here.
DOCS = [
    README,
    *sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in ("openai.md", "sharding.md")),
]
TABLE_HEADER = "| flag | env | default | meaning |"
MODULES = ("blockd", "computed", "gateway")


def _run(*args: str) -> str:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("BLOCKD_", "COMPUTED_", "GATEWAY_", "KVCACHE_"))
    }
    env["COLUMNS"] = "1000"  # one line per option's help
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@functools.cache
def help_entries(module: str) -> dict[str, str]:
    """--flag -> its whole help entry (`--no-x` of a boolean flag included), from `--help`."""
    entries: dict[str, list[str]] = {}
    names: list[str] = []
    for line in _run("-m", module, "--help").splitlines():
        if line.startswith("  -"):
            invocation = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            names = re.findall(r"(?<![\w-])(--[\w-]+)", invocation)
            text = [line.strip()]
            for flag in names:
                entries[flag] = text
        elif line.startswith("   ") and names:
            text.append(line.strip())
        else:
            names = []
    return {flag: " ".join(text) for flag, text in entries.items()}


def help_default(module: str, flag: str) -> str | None:
    """The default --help states (None: no default)."""
    entry = help_entries(module)[flag]
    if module == "blockd":
        found = re.search(r"\[[A-Z_]+; ([^\]]*)\]$", entry)
    else:
        found = re.search(r".*\(default: (.*?)\)$", entry)
    value = found.group(1) if found else None
    return None if value in (None, "None") else value


def flag_rows() -> list[tuple[str, str, list[str]]]:
    """(doc, module, cells) of every row of every flag table."""
    rows = []
    for doc in DOCS:
        module = None
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            bold = re.match(r"^\*\*(\w+)\*\*", line)
            if bold and bold.group(1) in MODULES:
                module = bold.group(1)
            if line.strip() == TABLE_HEADER:
                assert module, f"{doc.name}:{i + 1}: a flag table without its **program** heading"
                for row in lines[i + 2 :]:
                    if not row.startswith("|"):
                        break
                    cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
                    rows.append((f"{doc.name}:{module}", module, cells))
    return rows


ROWS = flag_rows()


def test_the_tables_are_found() -> None:
    modules = {module for _, module, _ in ROWS}
    assert modules == set(MODULES), modules
    assert len(ROWS) > 50


@pytest.mark.parametrize(("where", "module", "cells"), ROWS, ids=[f"{w}:{c[0]}" for w, _, c in ROWS])
def test_a_flag_row_is_what_help_says(where: str, module: str, cells: list[str]) -> None:
    flag_cell, env_cell, default_cell = cells[:3]
    flags = re.findall(r"`(--[\w-]+)", flag_cell)
    entries = help_entries(module)
    for flag in flags:
        assert flag in entries, f"{where}: `{module} --help` has no {flag}"
    if not flags:  # a row of environment variables only (a test hook)
        return
    for env in re.findall(r"`([A-Z][A-Z0-9_]+)`", env_cell):
        assert any(env in entries[f] for f in flags), f"{where}: {flags[0]} is not read from {env}"
    stated = help_default(module, flags[0])
    literal = re.fullmatch(r"`([^`]*)`|(\d[\d.]*)", default_cell)
    word = default_cell.split()[0].strip(",;").lower() if default_cell else ""
    if literal:
        value = literal.group(1) if literal.group(1) is not None else literal.group(2)
        same = stated == value or (_is_number(stated) and _is_number(value) and float(stated) == float(value))
        assert same, f"{where}: {flags[0]} defaults to {stated!r}, the doc says {value!r}"
    elif word in ("none", "off"):
        assert stated in (None, "False"), f"{where}: {flags[0]} defaults to {stated!r}, the doc says {word}"
    elif word == "on":
        assert stated == "True", f"{where}: {flags[0]} defaults to {stated!r}, the doc says on"


def _is_number(text: str | None) -> bool:
    return text is not None and re.fullmatch(r"\d+(\.\d+)?", text) is not None


@functools.cache
def kvctl_help(command: str | None = None) -> str:
    return _run("-m", "clients.kvctl", *([command] if command else []), "--help")


def kvctl_rows() -> list[tuple[str, str]]:
    rows = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == "| command | what it does |":
                for row in lines[i + 2 :]:
                    if not row.startswith("|"):
                        break
                    rows.append((doc.name, row))
    return rows


@pytest.mark.parametrize(("doc", "row"), kvctl_rows())
def test_a_kvctl_row_names_only_options_kvctl_has(doc: str, row: str) -> None:
    command = re.match(r"\| `(\w+)", row).group(1)
    known = kvctl_help(command) + kvctl_help()
    own = re.sub(r"(?:blockd|computed)'s `--[\w-]+`", "", row)  # a daemon's flag, named as such
    for option in set(re.findall(r"(--[\w-]+)", own)):
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", known), (
            f"{doc}: kvctl {command} has no {option}"
        )


def test_flush_is_documented_with_its_tier() -> None:
    assert "--tier" in kvctl_help("flush")
    assert any(row.startswith("| `flush") and "--tier" in row for _, row in kvctl_rows())


def test_every_make_target_and_variable_printed_exists() -> None:
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.MULTILINE))
    variables = set(re.findall(r"^(\w+) \??=", makefile, flags=re.MULTILINE))
    for doc in DOCS:
        for command in re.findall(r"(?:^|`)make ([^`\n#]*)", doc.read_text(), flags=re.MULTILINE):
            for word in command.split():
                if "=" in word:
                    assert word.split("=")[0] in variables, f"{doc.name}: make has no variable {word}"
                elif re.fullmatch(r"[a-z][\w-]*", word):
                    assert word in targets, f"{doc.name}: `make {command.strip()}`: no target {word}"
                else:
                    break


def test_every_relative_link_resolves() -> None:
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            if Path(target).name in ("openai.md", "sharding.md"):
                continue  # written by other engineers (docs/openai.md, docs/sharding.md)
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which is not there"


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 250
    setup = re.search(r"```sh\n(.*?)```", text, re.DOTALL).group(1)
    assert [line.split("#")[0].strip() for line in setup.strip().splitlines()] == ["make demo", "make test"]
    for topic in (
        "docs/architecture.md",
        "docs/operations.md",
        "docs/gpu.md",
        "docs/kernels.md",
        "docs/benchmarks.md",
    ):
        assert topic in text, f"the README links {topic}"
