"""The README's client commands run as written from the repository after `make demo` / `make test`."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from tests.daemons import REPO

README = (REPO / "README.md").read_text()
# Commands a reader copies: code-block lines and `inline code`.
_SNIPPETS = re.findall(r"`([^`\n]+)`", README) + re.findall(
    r"^(?:\.venv/bin/|python|kvctl)[^\n]*$", README, re.MULTILINE
)
# The compose health check runs inside the image, whose python has the packages.
_CONTAINER_ONLY = {"python -m clients.healthcheck ADDR"}


def test_client_commands_name_the_venv() -> None:
    bare = [
        s for s in _SNIPPETS if re.match(r"(python3? -m clients\.|kvctl )", s) and s not in _CONTAINER_ONLY
    ]
    assert not bare, f"run these with .venv/bin/...: {bare}"


def test_every_client_program_the_readme_names_answers_help() -> None:
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv: `make install` creates it")
    programs = set()
    for snippet in _SNIPPETS:
        found = re.match(r"\.venv/bin/(kvctl|python -m clients\.\w+)", snippet)
        if found:
            programs.add(found.group(0))
    assert {
        ".venv/bin/kvctl",
        ".venv/bin/python -m clients.demo",
        ".venv/bin/python -m clients.stack",
    } <= programs
    for program in sorted(programs):
        done = subprocess.run(
            [*shlex.split(program), "--help"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, f"{program} --help: {done.stderr}"
