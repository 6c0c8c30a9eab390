"""``image/requirements.lock``: what the agent image installs beside the project's wheel, every
file with its hash (pip's ``--require-hashes`` in ``image/build.sh`` and the Containerfile).

Its input, ``image/requirements.in``, is the agent's runtime: the project's core dependencies
but the notebook side's, and the ``[agent]`` extra, each with pyproject.toml's own specifier (a
new core dependency must be sorted into one or the other here). The lock pins each of them at a
version its specifier admits, and every pin has hashes. Nothing is downloaded.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Final

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

IMAGE: Final = Path(__file__).resolve().parents[2] / "image"
PYPROJECT: Final = IMAGE.parent / "pyproject.toml"
NOTEBOOK_SIDE: Final = frozenset({"jupyter-server", "ipywidgets", "ipython", "jupyter-client"})
"""Core dependencies that only the notebook side imports (the agent image leaves them out)."""


def _requirements(lines: list[str]) -> dict[str, Requirement]:
    parsed = [Requirement(line) for line in lines]
    return {canonicalize_name(r.name): r for r in parsed}


def _input() -> dict[str, Requirement]:
    lines = IMAGE.joinpath("requirements.in").read_text().splitlines()
    return _requirements([line for line in lines if line and not line.startswith("#")])


def _pins() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes), from the lock's ``name==version \\`` entries."""
    text = IMAGE.joinpath("requirements.lock").read_text()
    pins: dict[str, tuple[str, list[str]]] = {}
    for entry in re.split(r"\n(?=[A-Za-z0-9])", text):
        head = re.match(r"([A-Za-z0-9._-]+)==(\S+)", entry)
        if head is not None:
            pins[canonicalize_name(head[1])] = (
                head[2],
                re.findall(r"sha256:([0-9a-f]{64})", entry),
            )
    return pins


def test_the_input_is_the_agents_runtime_as_pyproject_states_it() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    core = _requirements(project["dependencies"])
    agent = _requirements(project["optional-dependencies"]["agent"])
    assert core.keys() >= NOTEBOOK_SIDE
    runtime = {name: r for name, r in core.items() if name not in NOTEBOOK_SIDE} | agent
    assert {name: str(r) for name, r in _input().items()} == {
        name: str(r) for name, r in runtime.items()
    }


def test_the_lock_pins_every_input_with_hashes() -> None:
    pins = _pins()
    assert not NOTEBOOK_SIDE & pins.keys()
    for name, requirement in _input().items():
        version, _ = pins[name]
        assert requirement.specifier.contains(version), (name, version)
    for name, (_, hashes) in pins.items():
        assert hashes, f"{name} has no hash"
