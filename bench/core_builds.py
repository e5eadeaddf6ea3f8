"""Run a measurement of blockd's directory core in a fresh process per build.

blockd's daemon runs the core compiled by mypyc where `make native` built it
(blockd/native.py) and the pure modules elsewhere; both cannot share a process (same
module names), and a benchmark process has usually imported the pure ones already. So a
core benchmark runs its `measure` in a child that chose its build first, and reports the
daemon's build as its headline.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from blockd import native

REPO = Path(__file__).resolve().parent.parent


def builds() -> tuple[str, ...]:
    """The builds to measure, the daemon's first: ("compiled", "pure") where the current
    compiled build exists, else ("pure",)."""
    return ("compiled", "pure") if native.is_built() else ("pure",)


def in_child(build: str, module: str, call: str) -> dict:
    """`module.call` (a call expression answering a JSON-able dict) in a fresh process on
    one build of the core: "compiled" or "pure". What the child prints before its answer
    is echoed here."""
    assert build in ("compiled", "pure"), f"build must be compiled or pure, got {build!r}"
    code = (
        "import json\n"
        "from blockd import native\n"
        f"native.enable({'on' if build == 'compiled' else 'off'!r})\n"
        f"from {module} import {call.split('(')[0]}\n"
        f"print(json.dumps({call}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the {build} run of {module} failed: {done.stderr[-2000:]}")
    *shown, answer = done.stdout.strip().splitlines()
    if shown:
        print("\n".join(shown))
    return json.loads(answer)


def loaded_build() -> str:
    """Which build of the core this process runs: "compiled" or "pure" (imports it)."""
    import blockd.pool  # noqa: F401 - the module whose build tells

    return "compiled" if native.is_enabled() else "pure"
