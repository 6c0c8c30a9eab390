"""The demo's up-front checks: each refusal says why and what would work, before anything starts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from jupyter_gpu_hotplug.demo import preflight
from jupyter_gpu_hotplug.demo.errors import DemoUnavailable
from jupyter_gpu_hotplug.demo.options import DemoOptions

from ..fixtures.agent import free_tcp_port


@pytest.mark.parametrize("platform", ["darwin", "win32", "freebsd14"])
def test_other_systems_are_told_the_demo_needs_linux(platform: str) -> None:
    with pytest.raises(DemoUnavailable) as caught:
        preflight.check_platform(platform)
    assert f"needs Linux, and this is {platform}" in caught.value.reason
    assert "Linux VM" in caught.value.hint


def test_linux_passes_the_platform_check() -> None:
    preflight.check_platform("linux")


def test_a_user_is_told_to_run_it_as_root_and_how() -> None:
    with pytest.raises(DemoUnavailable) as caught:
        preflight.check_root(1000)
    message = str(caught.value)
    assert "must run as root" in message
    assert "cgroup and a mount namespace for every kernel" in message
    assert "sudo " in caught.value.hint and "gpu-hotplug demo" in caught.value.hint
    assert "sudo bash .ci/demo" in caught.value.hint


def test_root_passes_the_root_check() -> None:
    preflight.check_root(0)


def test_the_hint_names_this_installations_jupyter() -> None:
    hint = preflight.rerun_as_root_hint()
    jupyter = Path(sys.executable).with_name("jupyter")
    assert str(jupyter) in hint


def test_a_busy_port_is_named_with_a_free_alternative(busy_port: int) -> None:
    with pytest.raises(DemoUnavailable) as caught:
        preflight.check_port("127.0.0.1", busy_port)
    assert f"Port {busy_port} on 127.0.0.1 is already in use" in caught.value.reason
    assert "--port" in caught.value.hint


def test_a_free_port_passes() -> None:
    preflight.check_port("127.0.0.1", free_tcp_port())


def test_an_address_of_another_machine_is_refused() -> None:
    # 192.0.2.0/24 is TEST-NET-1: never an address of this machine.
    with pytest.raises(DemoUnavailable) as caught:
        preflight.check_port("192.0.2.1", free_tcp_port())
    assert "does not belong to this machine" in caught.value.reason


def test_a_malformed_host_name_is_refused() -> None:
    with pytest.raises(DemoUnavailable) as caught:
        preflight.check_port("bad..name", 8888)
    assert "not an address or host name of this machine" in caught.value.reason


def test_a_socket_path_beyond_the_kernel_limit_is_refused() -> None:
    preflight.check_socket_path(Path("/tmp/short/agent.sock"))
    with pytest.raises(DemoUnavailable) as caught:
        preflight.check_socket_path(Path("/tmp/" + "d" * 100 + "/agent.sock"))
    assert "too long for the agent's unix socket" in caught.value.reason
    assert "--state-dir" in caught.value.hint


def test_a_state_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(DemoUnavailable) as caught:
        preflight.check_state_dir(file)
    assert "is not a directory" in caught.value.reason
    preflight.check_state_dir(tmp_path / "missing")  # Created later: fine.


def test_missing_jupyterlab_is_named_with_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "jupyterlab" else real_find_spec(name)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(DemoUnavailable) as caught:
        preflight.check_jupyterlab()
    assert "JupyterLab is not installed" in caught.value.reason
    assert "pip install 'jupyter-gpu-hotplug[demo]'" in caught.value.hint


def test_checks_run_in_the_order_a_user_fixes_them(busy_port: int) -> None:
    options = DemoOptions(port=busy_port)
    with pytest.raises(DemoUnavailable, match="needs Linux"):
        preflight.preflight(options, socket_path=None, platform="darwin", euid=1000)
    with pytest.raises(DemoUnavailable, match="must run as root"):
        preflight.preflight(options, socket_path=None, platform="linux", euid=1000)


def test_a_notebook_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    with pytest.raises(DemoUnavailable) as caught:
        preflight.check_notebook_dir(a_file)
    assert f"--notebook-dir {a_file} exists and is not a directory" in caught.value.reason
    assert "current directory" in caught.value.hint


def test_a_missing_or_existing_notebook_dir_passes(tmp_path: Path) -> None:
    preflight.check_notebook_dir(tmp_path)
    preflight.check_notebook_dir(tmp_path / "new" / "notebooks")
