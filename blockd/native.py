"""blockd's core compiled to C with mypyc, for the daemon: same source, same behaviour, less CPU.

The directory's per-block work (hashing walks, the eviction heap and policies, ghost and
key memory, commits, releases) is plain Python objects and loops; CPython interprets it
at about half a microsecond per operation, which caps one blockd process well below a
fleet's admission rate (issue 43). mypyc compiles these same modules (`MODULES`), typed
as they are, into C extension modules: attribute access becomes a struct read, calls
between them direct calls, int and float arithmetic unboxed. No second implementation
exists, so there is no second copy of a rule to keep in step.

Build: `python -m blockd.native` (`make install` runs it; mypy, a dev dependency,
compiles). The build goes to `build/native/<key>/` under the checkout (or
BLOCKD_NATIVE_BUILD_DIR), keyed by the compiled sources, mypy's version, Python's and the
machine's: an edited source changes the key, so a stale build is never loaded, and
until it is rebuilt the daemon runs the pure modules.

Use: the daemon (`python -m blockd`) calls `enable()` before it imports the directory.
BLOCKD_NATIVE: `auto` (the default: compiled where the current build exists, else pure,
and the start-up log says which and why), `on` (refuse to start without it), `off`.
A process that imports blockd as a library (tests, benchmarks, tools) gets the pure
modules unless it calls `enable()` itself first: pure Python accepts what the annotations
do not promise (a tuple where a list is typed, say), compiled code raises TypeError.
`tests/conftest.py` enables it for a whole test run under BLOCKD_NATIVE=on, which is
how `make test` checks the compiled core against the same tests (`make test-native`).

Measured (BENCHMARKS.md section 5, both builds side by side in one run): `python -m
bench.blockd_inprocess` (the capacity bench's Steps through the servicer in process: CPU
per admission 1.5-1.6x lower) and `python -m bench.blockd_grpc` (admissions/s over gRPC:
1.38x).

Not used: mypyc's `acyclic` classes (instances the collector never tracks, which the
directory's records could be: they hold no cycles). Deallocating a chain of them deeper than
CPython's trashcan limit (a 4,096-token prompt's 256 blocks) crashed the process
(`bench.blockd_inprocess`, mypy 2.4, CPython 3.11): the trashcan needs the GC header
acyclic instances lack. So the records stay tracked; `blockd.server._tune_gc` keeps the
collector's pauses short instead (young collections only).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import blockd

ENV = "BLOCKD_NATIVE"
BUILD_DIR_ENV = "BLOCKD_NATIVE_BUILD_DIR"
MODES = ("auto", "on", "off")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# The compiled modules: the Step path's per-block and per-op work, from the wire conversion
# and validation to the directory. The servicer (gRPC's async machinery) and the tiers
# (they rebind methods per instance, which compiled classes forbid) stay interpreted.
MODULES = (
    "admission",
    "allocator",
    "block",
    "directory",
    "events",
    "eviction",
    "ghosts",
    "hashing",
    "host_tier",
    "leases",
    "messages",
    "minisim",
    "pins",
    "pool",
    "prompt",
    "shared_tier",
    "sightings",
    "validation",
)
_DONE = "built"  # written last: a folder without it is a build that did not finish


class NativeUnavailable(RuntimeError):
    """BLOCKD_NATIVE=on, and the compiled core cannot be loaded (the message says why)."""


def sources() -> list[Path]:
    return [HERE / f"{name}.py" for name in MODULES]


def build_key() -> str:
    """What the build depends on: the compiled sources, mypy's version (read from its
    metadata, so asking costs no import), Python's and the machine's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        mypy_version = version("mypy")
    except PackageNotFoundError:
        mypy_version = "none"
    digest = hashlib.sha256()
    for path in sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"{mypy_version}|{sys.version}|{platform.machine()}|{sys.platform}".encode())
    return digest.hexdigest()[:20]


def build_root() -> Path:
    return Path(os.environ.get(BUILD_DIR_ENV) or ROOT / "build" / "native")


def build_dir() -> Path:
    return build_root() / build_key()


def is_built() -> bool:
    return _complete(build_dir())


def _complete(target: Path) -> bool:
    return (target / _DONE).exists()


def build(*, quiet: bool = True) -> Path:
    """Compile `MODULES` into `build_dir()` (a no-op when it is complete); answers it.
    Runs mypyc in a child process (its setuptools build must not touch this one)."""
    target = build_dir()
    if _complete(target):
        return target
    try:
        import mypyc  # noqa: F401
    except ImportError as exc:
        raise NativeUnavailable("mypy is not installed (pip install mypy, or make install)") from exc
    work = Path(tempfile.mkdtemp(prefix="blockd-native-"))
    try:
        out = work / "out"
        paths = [str(p.relative_to(ROOT)) for p in sources()]
        done = subprocess.run(
            [sys.executable, "-m", "blockd.native", "--mypyc", str(work), str(out), *paths],
            cwd=ROOT,
            check=False,
            capture_output=quiet,
            text=True,
        )
        if done.returncode:
            detail = (done.stdout or "")[-4000:] + (done.stderr or "")[-4000:]
            raise NativeUnavailable(f"mypyc failed (exit {done.returncode}):\n{detail}")
        staging = Path(tempfile.mkdtemp(prefix="staging-", dir=_made(build_root())))
        (staging / "blockd").mkdir()
        (staging / "lib").mkdir()
        for lib in out.glob("*.so"):  # the shared runtime every compiled module imports
            shutil.copy2(lib, staging / "lib" / lib.name)
        for lib in (out / "blockd").glob("*.so"):
            shutil.copy2(lib, staging / "blockd" / lib.name)
        found = {lib.name.split(".")[0] for lib in (staging / "blockd").iterdir()}
        assert found == set(MODULES), f"mypyc built {sorted(found)}, not {sorted(MODULES)}"
        (staging / _DONE).write_text(target.name + "\n")
        if target.exists():  # a build that did not finish
            shutil.rmtree(target)
        staging.rename(target)
        for old in build_root().iterdir():  # builds of earlier sources: never loaded again
            if old != target and len(old.name) == len(target.name) and _complete(old):
                shutil.rmtree(old, ignore_errors=True)
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _mypyc(work: Path, out: Path, paths: list[str]) -> None:
    """mypyc on `paths` (relative to ROOT, the working directory), its C in `work`, the
    extension modules into `out` (`build` runs this in a child process)."""
    from mypyc.build import mypycify
    from setuptools import Distribution

    modules = mypycify(
        ["--ignore-missing-imports", "--follow-imports=silent", *paths],
        opt_level="3",
        target_dir=str(work / "c"),
    )
    command = Distribution({"name": "blockd-native", "ext_modules": modules}).get_command_obj("build_ext")
    command.build_lib, command.build_temp = str(out), str(work / "temp")
    command.ensure_finalized()
    command.run()


def _made(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def enable(mode: str | None = None) -> str:
    """Load the compiled modules in place of the pure ones for this process, where the
    current build exists; answers what happened ("on: DIR" or "off: why"), for the
    start-up log. Must run before any of `MODULES` is imported. `mode` defaults to
    BLOCKD_NATIVE; `on` raises NativeUnavailable where `auto` falls back."""
    mode = (mode or os.environ.get(ENV) or "auto").lower()
    if mode not in MODES:
        raise NativeUnavailable(f"{ENV}={mode!r}: choose one of {', '.join(MODES)}")
    if mode == "off":
        return f"off: {ENV}=off"
    loaded = sorted(name for name in MODULES if f"blockd.{name}" in sys.modules)
    target = build_dir()
    if loaded and not _is_native(loaded[0]):
        why = f"blockd.{loaded[0]} was imported before enable()"
    elif not _complete(target):
        why = f"no build for these sources at {target} (run: make native)"
    else:
        why = None
    if why is not None:
        if mode == "on":
            raise NativeUnavailable(why)
        return f"off: {why}"
    if str(target / "lib") not in sys.path:
        sys.path.insert(0, str(target / "lib"))
    package_path = str(target / "blockd")
    if package_path not in blockd.__path__:
        blockd.__path__.insert(0, package_path)
    return f"on: {target}"


def enable_for_daemon() -> str:
    """`enable()` for a daemon's start: a bad BLOCKD_NATIVE, or `on` without a current
    build, exits 2 with the reason."""
    try:
        return enable()
    except NativeUnavailable as exc:
        sys.stderr.write(f"blockd: {ENV}: {exc}\n")
        raise SystemExit(2) from None


def daemon_main() -> int:
    """The `blockd` console script: as `python -m blockd`, the core chosen before the
    daemon's modules load (blockd.__main__ imports the directory)."""
    status = enable_for_daemon()
    from blockd import __main__ as daemon

    return daemon.main(native_status=status)


def is_enabled() -> bool:
    """Whether this process's directory core is the compiled one."""
    return _is_native("pool") if "blockd.pool" in sys.modules else False


def _is_native(name: str) -> bool:
    module = sys.modules.get(f"blockd.{name}")
    return module is not None and not str(getattr(module, "__file__", "")).endswith(".py")


def main() -> int:
    if sys.argv[1:2] == ["--mypyc"]:  # the child process of `build`
        _mypyc(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
        return 0
    try:
        target = build(quiet="-v" not in sys.argv[1:])
    except NativeUnavailable as exc:
        sys.stderr.write(f"blockd.native: {exc}\n")
        return 1
    sys.stdout.write(f"blockd's compiled core: {target}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
