"""Adopting a state directory and token someone else prepared is refused (issue 9).

Each case is an attack found by the red team: a directory or token planted in a shared
temporary directory by another user, one writable by others, a symlink. The refusal names the
path, the owner and the mode; nothing is created or changed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from jupyter_gpu_hotplug.agent.app import AgentApp
from jupyter_gpu_hotplug.agent.local.identity import TokenError, load_or_create_token
from jupyter_gpu_hotplug.agent.statedir import UnsafeStateError, prepare_state_dir

from ..fixtures.requirements import needs_root

NOBODY = 65534
TOKEN = "planted-token-0123456789abcdefghij"


def test_a_new_state_dir_is_made_private(tmp_path: Path) -> None:
    state = tmp_path / "a" / "state"

    prepare_state_dir(state)
    prepare_state_dir(state)  # adopting its own directory again is fine

    assert stat.S_IMODE(state.stat().st_mode) == 0o700


def test_a_sticky_world_writable_parent_is_fine(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)

    prepare_state_dir(shared / "state")


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_state_dir_writable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(mode)

    with pytest.raises(
        UnsafeStateError, match=rf"{state}: .*owner uid 0 \(root\), mode {mode:04o}"
    ):
        prepare_state_dir(state)


def test_a_parent_writable_by_others_without_sticky_bit_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)

    with pytest.raises(UnsafeStateError, match=rf"{parent}: group or others may change it"):
        prepare_state_dir(parent / "state")
    assert not (parent / "state").exists()


def test_a_symlinked_state_dir_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "state").symlink_to(real)

    with pytest.raises(UnsafeStateError, match="symlink"):
        prepare_state_dir(tmp_path / "state")


def test_a_state_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("")

    with pytest.raises(UnsafeStateError, match="not a directory"):
        prepare_state_dir(tmp_path / "state")


@needs_root
def test_someone_elses_state_dir_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, NOBODY, NOBODY)

    with pytest.raises(UnsafeStateError, match=rf"{state}: it belongs to someone else.*65534"):
        prepare_state_dir(state)


@needs_root
def test_someone_elses_token_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    os.chown(token, NOBODY, NOBODY)

    with pytest.raises(TokenError, match=rf"{token}: it belongs to someone else.*mode 0600"):
        load_or_create_token(token)


def test_a_symlinked_token_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.write_text(TOKEN)
    real.chmod(0o600)
    (tmp_path / "token").symlink_to(real)

    with pytest.raises(TokenError, match="symlink"):
        load_or_create_token(tmp_path / "token")


def test_help_examples_use_no_shared_temporary_directory() -> None:
    assert "/tmp" not in AgentApp.examples
