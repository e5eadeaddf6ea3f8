"""bench.core_builds: a core benchmark's child runs the build it was asked for."""

from __future__ import annotations

import pytest

from bench import core_builds


def test_the_daemons_build_comes_first() -> None:
    assert core_builds.builds()[-1] == "pure"
    assert core_builds.builds()[0] == ("compiled" if core_builds.native.is_built() else "pure")


@pytest.mark.parametrize("build", core_builds.builds())
def test_a_child_runs_the_build_it_was_asked_for(build: str) -> None:
    assert core_builds.in_child(build, "bench.core_builds", "loaded_build()") == build
