"""A test that needs a node component while ``build.sh`` runs waits for that component's stamp
(``.ci/test`` starts the real-node lane's tests beside a cold build), and only then."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import components
from .components import CACHE_ENV, MissingComponents, build_running

PINNED = {"RUNC_VERSION": "v9.9.9"}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def build(cache: Path) -> Iterator[int]:
    """``build.sh`` running: its lock held exclusively (another open file description, so this
    process's own look at the lock sees it taken)."""
    lock = os.open(cache / ".build.lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        yield lock
    finally:
        os.close(lock)


def _stamp(cache: Path) -> Path:
    built = cache / "bin" / "runc-v9.9.9"
    built.mkdir(parents=True)
    (built / ".built").write_text("recipe")
    return built


def test_no_build_running_and_nothing_built_says_how_to_build_at_once(cache: Path) -> None:
    assert not build_running()
    with pytest.raises(MissingComponents, match=r"runc v9\.9\.9 is not built.*build\.sh"):
        components._component_dir("runc", "RUNC_VERSION", PINNED)


def test_a_running_build_is_waited_for_until_it_stamps_the_component(
    cache: Path, build: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert build_running()
    looks: list[float] = []

    def poll(seconds: float) -> None:
        looks.append(seconds)
        if len(looks) == 3:  # the build gets there while the test waits
            _stamp(cache)

    monkeypatch.setattr("tests.realnode.components.time.sleep", poll)
    found = components._component_dir("runc", "RUNC_VERSION", PINNED)
    assert found == cache / "bin" / "runc-v9.9.9"
    assert looks == [components.BUILD_POLL] * 3
    assert build_running()  # the rest of the build goes on: it was not waited for


def test_a_build_that_ends_without_the_component_fails_the_wait(
    cache: Path, build: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def poll(seconds: float) -> None:
        fcntl.flock(build, fcntl.LOCK_UN)  # the build ends (failed) while the test waits

    monkeypatch.setattr("tests.realnode.components.time.sleep", poll)
    with pytest.raises(MissingComponents, match=r"runc v9\.9\.9 is not built"):
        components._component_dir("runc", "RUNC_VERSION", PINNED)


def test_a_built_component_is_found_without_looking_at_the_build(
    cache: Path, build: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = _stamp(cache)
    monkeypatch.setattr(components, "build_running", lambda: pytest.fail("looked at the build"))
    assert components._component_dir("runc", "RUNC_VERSION", PINNED) == built
