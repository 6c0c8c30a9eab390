"""Holders in a notebook user's words: the notebook next to the process id, or the pod."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import PidRef, PodTarget
from jupyter_gpu_hotplug.kernel.holders import SESSION_ENV, HolderNames, session_of

OWN = {SESSION_ENV: "/home/u/work/mine.ipynb"}


@pytest.fixture
def other_kernel(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process started like a notebook session's kernel: with the notebook's path."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, SESSION_ENV: "/home/u/work/team/other.ipynb"},
    )
    try:
        yield child
    finally:
        child.kill()
        child.wait()


def test_this_kernel_is_named_by_its_notebook() -> None:
    names = HolderNames(own_pid=4242, environ=OWN, session_of=lambda pid: None)
    assert names.describe(PidRef(4242)) == "this notebook (mine.ipynb, process 4242)"


def test_a_kernel_without_a_notebook_session_is_this_kernel() -> None:
    names = HolderNames(own_pid=4242, environ={}, session_of=lambda pid: None)
    assert names.describe(PidRef(4242)) == "this kernel (process 4242)"


def test_another_kernel_is_named_by_the_notebook_in_its_environment(
    other_kernel: subprocess.Popen[bytes],
) -> None:
    names = HolderNames(own_pid=os.getpid(), environ=OWN)
    assert names.describe(PidRef(other_kernel.pid)) == (
        f"team/other.ipynb (process {other_kernel.pid})"
    )
    assert session_of(other_kernel.pid) == "/home/u/work/team/other.ipynb"


def test_a_process_whose_notebook_cannot_be_known_stays_a_process(tmp_path: Path) -> None:
    names = HolderNames(own_pid=os.getpid(), environ=OWN, session_of=lambda pid: None)
    assert names.describe(PidRef(99999)) == "process 99999"
    assert session_of(99999, proc=tmp_path) is None, "gone, or not ours to read"
    assert session_of(os.getpid(), proc=tmp_path) is None


def test_a_notebook_elsewhere_keeps_its_whole_path() -> None:
    names = HolderNames(own_pid=1000, environ=OWN, session_of=lambda pid: "/srv/x/y.ipynb")
    assert names.describe(PidRef(2000)) == "/srv/x/y.ipynb (process 2000)"


def test_pods_and_no_holder() -> None:
    names = HolderNames(own_pid=1000, environ=OWN)
    assert names.describe(PodTarget("team-a", "jupyter-ann", "notebook")) == (
        "pod team-a/jupyter-ann container notebook"
    )
    assert names.describe(None) == ""


def test_tables_use_the_short_name() -> None:
    """``%gpu list``'s HELD BY: the notebook as this one would write it, without the pid."""
    notebooks = {2000: "/home/u/work/team/other.ipynb", 3000: "/srv/x/y.ipynb"}
    names = HolderNames(own_pid=1000, environ=OWN, session_of=notebooks.get)
    assert names.name(PidRef(1000)) == "this notebook"
    assert names.name(PidRef(2000)) == "team/other.ipynb"
    assert names.name(PidRef(3000)) == "y.ipynb", "elsewhere: its file name"
    assert names.name(PidRef(4000)) == "process 4000"
    assert names.name(PodTarget("team-a", "jupyter-ann", "notebook")) == "pod team-a/jupyter-ann"
    assert names.name(None) == ""
