"""The demo directory and the starter notebook copied into it."""

from __future__ import annotations

import stat
from pathlib import Path

from jupyter_gpu_hotplug.demo.layout import STARTER_NOTEBOOK, DemoLayout, starter_notebook_text


def test_prepare_makes_the_directories_the_demo_writes(tmp_path: Path) -> None:
    layout = DemoLayout(tmp_path / "demo", tmp_path / "work" / "notebooks")
    layout.prepare()
    assert layout.notebooks.is_dir()
    assert stat.S_IMODE(layout.lab_dir.stat().st_mode) == 0o700, "it holds the token"
    layout.prepare()  # A kept --state-dir is prepared again on the next run.


def test_the_starter_is_copied_once_and_an_edited_one_is_kept(tmp_path: Path) -> None:
    layout = DemoLayout(tmp_path / "state", tmp_path / "notebooks")
    layout.prepare()
    starter = layout.install_starter()
    assert starter == tmp_path / "notebooks" / STARTER_NOTEBOOK
    assert starter.read_text() == starter_notebook_text()
    starter.write_text("{}")
    layout.install_starter()
    assert starter.read_text() == "{}"


def test_remove_deletes_the_run_state_and_keeps_the_notebooks(tmp_path: Path) -> None:
    layout = DemoLayout(tmp_path / "demo", tmp_path / "notebooks")
    layout.prepare()
    layout.install_starter()
    (layout.notebooks / "mine.ipynb").write_text("{}")
    layout.remove()
    assert not layout.root.exists()
    assert (layout.notebooks / "mine.ipynb").read_text() == "{}"
    assert layout.starter.exists()


def test_the_agent_socket_and_token_live_in_the_run_directory() -> None:
    layout = DemoLayout(Path("/tmp/d"), Path("/home/u/work"))
    assert layout.agent_url == "unix:/tmp/d/agent.sock"
    assert layout.agent_token == Path("/tmp/d/agent/token")
    assert layout.simulation_config.parent == Path("/tmp/d/simulation")
