"""Container cgroups under both drivers and three runtimes, from the ``/proc/<pid>/cgroup``
lines and OCI ``cgroupsPath`` values; and the ``/proc`` scan over a fake procfs tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_gpu_hotplug.agent.kubernetes.container_cgroups import (
    belongs_to,
    expected_cgroup,
    find_container_pid,
)

ID = "4c5e0f3d9a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5"
OTHER = "9" * 64
UID = "0b6c5d1e_2f3a_4b5c_8d7e_6f5a4b3c2d1e"


@pytest.mark.parametrize(
    ("cgroups_path", "proc_path"),
    [
        pytest.param(
            f"/kubepods/burstable/pod{UID}/{ID}",
            f"/kubepods/burstable/pod{UID}/{ID}",
            id="cgroupfs",
        ),
        pytest.param(
            f"kubepods-burstable-pod{UID}.slice:cri-containerd:{ID}",
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID}.slice/"
            f"cri-containerd-{ID}.scope",
            id="systemd-containerd",
        ),
        pytest.param(
            f"kubepods-pod{UID}.slice:crio:{ID}",
            f"/kubepods.slice/kubepods-pod{UID}.slice/crio-{ID}.scope",
            id="systemd-crio-guaranteed",
        ),
        pytest.param("system.slice:docker:abc", "/system.slice/docker-abc.scope", id="docker"),
        pytest.param("-.slice:x:y.slice", "/y.slice", id="root-slice"),
    ],
)
def test_expected_cgroup_matches_what_proc_shows(cgroups_path: str, proc_path: str) -> None:
    assert expected_cgroup(cgroups_path) == proc_path


@pytest.mark.parametrize(
    ("path", "belongs"),
    [
        (f"/kubepods/burstable/pod{UID}/{ID}", True),
        (f"/kubepods/pod{UID}/{ID}/container", True),  # crun's inner leaf
        (f"/kubepods.slice/kubepods-pod{UID}.slice/cri-containerd-{ID}.scope", True),
        (f"/kubepods.slice/kubepods-pod{UID}.slice/crio-{ID}.scope/container", True),
        (f"/kubepods/burstable/pod{UID}/{OTHER}", False),
        (f"/kubepods/burstable/pod{UID}", False),
        (f"/kubepods/burstable/{ID}x", False),
        (f"/-{ID}.scope", False),  # no runtime prefix
        (f"/{ID}/child", False),  # a child cgroup is not the container's own
        ("/", False),
    ],
)
def test_belongs_to(path: str, belongs: bool) -> None:
    assert belongs_to(path, ID) is belongs


def _process(proc: Path, pid: int, start: int, cgroup: str) -> None:
    (proc / str(pid)).mkdir()
    (proc / str(pid) / "stat").write_text(
        f"{pid} (sh) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {start} 0 0\n"
    )
    (proc / str(pid) / "cgroup").write_text(cgroup)


def test_find_container_pid_picks_the_oldest_member(tmp_path: Path) -> None:
    scope = f"/kubepods.slice/kubepods-pod{UID}.slice/cri-containerd-{ID}.scope"
    _process(tmp_path, 10, 500, f"12:devices:{scope}\n0::{scope}\n")
    _process(tmp_path, 11, 400, f"0::{scope}/container\n")
    _process(tmp_path, 12, 100, f"0::/kubepods/pod{UID}/{OTHER}\n")
    _process(tmp_path, 13, 50, "garbage")
    (tmp_path / "self").mkdir()
    assert find_container_pid(ID, proc=tmp_path) == 11
    assert find_container_pid("f" * 64, proc=tmp_path) is None
