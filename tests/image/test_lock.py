"""Each image's ``requirements.lock``: what ``image/build.sh --image KIND`` installs beside the
project's wheel, every file with its hash (pip's ``--require-hashes`` in the Containerfiles).

Each input (``requirements.in``) is that image's runtime as pyproject.toml states it, with
pyproject's own specifiers (a new core dependency must be sorted into each image here):

- agent: the core dependencies but the notebook side's, and the ``[agent]`` extra;
- notebook: every core dependency and the ``[lab]`` extra, not the ``[agent]`` extra, and
  jupyterhub (``jupyterhub-singleuser``);
- hub: jupyterhub and jupyterhub-kubespawner, and the one core dependency that
  ``jupyter_gpu_hotplug.spawner`` imports (traitlets); no notebook-side package.

The lines pyproject does not state (the hub's packages, pinned to the majors tested) are named
here, and their pins must also meet the ``[hub]`` extra; the notebook's and the hub's lock pin
the same jupyterhub. Every pin is admitted by its input's specifier and has hashes. Nothing is
downloaded.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

IMAGE: Final = Path(__file__).resolve().parents[2] / "image"
PROJECT: Final[dict[str, Any]] = tomllib.loads((IMAGE.parent / "pyproject.toml").read_text())[
    "project"
]
NOTEBOOK_SIDE: Final = frozenset({"jupyter-server", "ipywidgets", "ipython", "jupyter-client"})
"""Core dependencies that only the notebook side imports (the agent image leaves them out)."""


def _requirements(lines: list[str]) -> dict[str, Requirement]:
    parsed = [Requirement(line) for line in lines]
    return {canonicalize_name(r.name): r for r in parsed}


CORE: Final = _requirements(PROJECT["dependencies"])
EXTRAS: Final = {
    name: _requirements(lines) for name, lines in PROJECT["optional-dependencies"].items()
}


@dataclass(frozen=True)
class Lock:
    directory: Path
    from_pyproject: Callable[[], dict[str, Requirement]]
    """What pyproject.toml says this image runs."""
    image_only: frozenset[str] = frozenset()
    """Inputs pyproject.toml does not state with this specifier (the [hub] extra's packages)."""
    left_out: frozenset[str] = frozenset()
    """Packages the lock must not pin at all."""

    def input(self) -> dict[str, Requirement]:
        lines = self.directory.joinpath("requirements.in").read_text().splitlines()
        return _requirements([line for line in lines if line and not line.startswith("#")])

    def pins(self) -> dict[str, tuple[str, list[str]]]:
        """name -> (version, hashes), from the lock's ``name==version \\`` entries."""
        text = self.directory.joinpath("requirements.lock").read_text()
        pins: dict[str, tuple[str, list[str]]] = {}
        for entry in re.split(r"\n(?=[A-Za-z0-9])", text):
            head = re.match(r"([A-Za-z0-9._-]+)==(\S+)", entry)
            if head is not None:
                pins[canonicalize_name(head[1])] = (
                    head[2],
                    re.findall(r"sha256:([0-9a-f]{64})", entry),
                )
        return pins


LOCKS: Final = {
    "agent": Lock(
        IMAGE,
        lambda: {n: r for n, r in CORE.items() if n not in NOTEBOOK_SIDE} | EXTRAS["agent"],
        left_out=NOTEBOOK_SIDE,
    ),
    "notebook": Lock(
        IMAGE / "notebook",
        lambda: CORE | EXTRAS["lab"],
        image_only=frozenset({"jupyterhub"}),
        left_out=frozenset(EXTRAS["agent"]),
    ),
    "hub": Lock(
        IMAGE / "hub",
        lambda: {"traitlets": CORE["traitlets"]},
        image_only=frozenset({"jupyterhub", "jupyterhub-kubespawner"}),
        left_out=NOTEBOOK_SIDE | frozenset(EXTRAS["agent"]),
    ),
}


def test_the_notebook_side_is_in_the_core() -> None:
    assert CORE.keys() >= NOTEBOOK_SIDE


@pytest.mark.parametrize("kind", LOCKS)
def test_the_input_is_the_images_runtime_as_pyproject_states_it(kind: str) -> None:
    lock = LOCKS[kind]
    given = lock.input()
    assert given.keys() >= lock.image_only
    assert {n: str(r) for n, r in given.items() if n not in lock.image_only} == {
        n: str(r) for n, r in lock.from_pyproject().items()
    }


@pytest.mark.parametrize("kind", LOCKS)
def test_the_lock_pins_every_input_with_hashes(kind: str) -> None:
    lock = LOCKS[kind]
    pins = lock.pins()
    assert not lock.left_out & pins.keys()
    for name, requirement in lock.input().items():
        version, _ = pins[name]
        assert requirement.specifier.contains(version), (name, version)
        if name in lock.image_only:
            assert EXTRAS["hub"][name].specifier.contains(version), (name, version, "[hub]")
    for name, (_, hashes) in pins.items():
        assert hashes, f"{name} has no hash"


def test_the_notebooks_and_the_hubs_jupyterhub_are_the_same() -> None:
    """``jupyterhub-singleuser`` talks to the hub's API: one version on both sides."""
    assert LOCKS["notebook"].pins()["jupyterhub"][0] == LOCKS["hub"].pins()["jupyterhub"][0]
