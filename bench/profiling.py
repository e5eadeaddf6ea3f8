"""Sample a running daemon with py-spy and summarise where its time went.

Used when a goal is missed, so the report says what limits it from a profile. py-spy
is optional (dev extra): without it `PySpy.available()` is False and callers say so.
"""

from __future__ import annotations

import collections
import linecache
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Self

_LOCATION = re.compile(r" \((?P<file>[^():]+):(?P<line>\d+)\)$")
REPO = Path(__file__).resolve().parent.parent


def _executable() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


class PySpy:
    """`with PySpy(pid, out_file): ...` records raw (collapsed) stacks at `rate` Hz."""

    def __init__(self, pid: int, out: Path, rate: int = 200) -> None:
        self.pid = pid
        self.out = out
        self.rate = rate
        self._proc: subprocess.Popen | None = None

    @staticmethod
    def available() -> bool:
        return _executable() is not None

    def __enter__(self) -> Self:
        exe = _executable()
        assert exe is not None, "py-spy is not installed"
        self._proc = subprocess.Popen(
            [
                exe,
                "record",
                "-p",
                str(self.pid),
                "-f",
                "raw",
                "-o",
                str(self.out),
                "-r",
                str(self.rate),
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # attach before the workload starts
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)


def summarize(raw: Path, top: int = 8) -> str:
    """Markdown: the source lines with most samples on top of the stack (own time), and
    the functions with most samples anywhere on it (inclusive time)."""
    if not raw.is_file():
        return "(py-spy wrote no profile: it could not attach, e.g. ptrace is not permitted here)"
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[_short(frames[-1], keep_line=True)] += n
        for name in {_short(f, keep_line=False) for f in frames}:
            inclusive[name] += n
    if total == 0:
        return "(py-spy recorded no samples)"
    skip = (
        "threading.py",
        "concurrent/futures",
        "_contextlib.py",
        "runpy",
        "asyncio/runners.py",
        "module.py",
        "computed/__main__.py",
    )
    rows = ["| own time | source line | | inclusive | function |", "|---|---|---|---|---|"]
    inc = [(k, v) for k, v in inclusive.most_common() if not any(s in k for s in skip)][:top]
    for (o_name, o_n), (i_name, i_n) in zip(own.most_common(top), inc):
        code = _source(o_name)
        rows.append(
            f"| {o_n / total:.1%} | `{o_name}`{f': `{code}`' if code else ''} | | {i_n / total:.1%} | "
            f"`{i_name}` |"
        )
    return f"{total:,} samples.\n\n" + "\n".join(rows)


def _source(name: str) -> str:
    """The text of a `function (file:line)` location inside this repository."""
    match = _LOCATION.search(name)
    if match is None or not (REPO / match["file"]).is_file():
        return ""
    return linecache.getline(str(REPO / match["file"]), int(match["line"])).strip().replace("|", "\\|")


def _short(frame: str, keep_line: bool) -> str:
    match = _LOCATION.search(frame)
    if match is None:
        return frame
    function = frame[: match.start()]
    where = match["file"].split("site-packages/")[-1]
    return f"{function} ({where}:{match['line']})" if keep_line else f"{function} ({where})"
