"""The driver's files in the attach and detach flow: refused before anything is reserved,
given after the grant (a failure takes the grant back), taken back with the last GPU, swept
when no reservation backs them; and ``CdiDriverFiles``'s own decisions."""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import PidRef, PidTarget
from jupyter_gpu_hotplug.agent.core.driver_files import (
    CdiDriverFiles,
    DriverFilesFailed,
    DriverFilesMode,
)
from jupyter_gpu_hotplug.agent.core.errors import Busy, TargetNotReady
from jupyter_gpu_hotplug.agent.core.injector import DeviceInUse, HolderInfo
from jupyter_gpu_hotplug.agent.core.seams import (
    AttachRequest,
    ContainerCgroups,
    ContainerKey,
    HostContainer,
)
from jupyter_gpu_hotplug.linux import procfs
from jupyter_gpu_hotplug.linux.cdi_spec import CdiRegistry
from jupyter_gpu_hotplug.linux.devnodes import DeviceNode
from jupyter_gpu_hotplug.linux.devrules import CharDevice

from ..linux.test_cdi_spec import nvidia_spec, write
from .service_harness import ADMIN, Harness


@dataclass
class RecordingDriverFiles:
    """``DriverFiles`` that records its calls and fails where a test says."""

    refuse: bool = False
    fail: bool = False
    calls: list[tuple[str, int]] = field(default_factory=list)
    swept: list[frozenset[ContainerKey]] = field(default_factory=list)

    def check(self, target: HostContainer) -> None:
        self.calls.append(("check", target.pid))
        if self.refuse:
            raise TargetNotReady("cannot load libcuda.so.1", retryable=False)

    def provide(self, target: HostContainer, nodes: Sequence[DeviceNode]) -> None:
        self.calls.append(("provide", target.pid))
        if self.fail:
            raise DriverFilesFailed("the mount helper failed")

    def withdraw(self, target: HostContainer) -> None:
        self.calls.append(("withdraw", target.pid))

    def sweep(self, holding: Collection[ContainerKey]) -> list[str]:
        self.swept.append(frozenset(holding))
        return []


@pytest.fixture
def files(harness: Harness) -> RecordingDriverFiles:
    recording = RecordingDriverFiles()
    harness.core.driver_files = recording
    return recording


def request(count: int = 1, pid: int = 100) -> AttachRequest:
    return AttachRequest(count=count, target=PidRef(pid), wait_seconds=60.0, request_id=None)


async def test_a_target_that_could_not_use_a_gpu_is_refused_before_anything_is_reserved(
    harness: Harness, files: RecordingDriverFiles
) -> None:
    harness.host.spawn(100, "kernel-a")
    files.refuse = True
    with pytest.raises(TargetNotReady, match="libcuda"):
        await harness.service.attach(ADMIN, request())
    assert harness.core.allocator.all_attachments() == []
    assert harness.injector.calls == []
    assert files.calls == [("check", 100)]


async def test_the_files_come_after_the_grant_and_a_failure_takes_the_grant_back(
    harness: Harness, files: RecordingDriverFiles
) -> None:
    harness.host.spawn(100, "kernel-a")
    files.fail = True
    with pytest.raises(TargetNotReady, match="mount helper"):
        await harness.service.attach(ADMIN, request())
    assert [call[0] for call in harness.injector.calls] == ["grant", "revoke"]
    assert harness.injector.usable(PidTarget(100, harness.host.processes[100].start_time)) == set()
    assert harness.core.allocator.all_attachments() == []
    assert files.calls == [("check", 100), ("provide", 100)]


async def test_the_files_go_with_the_last_gpu_only(
    harness: Harness, files: RecordingDriverFiles
) -> None:
    harness.host.spawn(100, "kernel-a")
    attached = await harness.service.attach(ADMIN, request(2))
    first, second = (a["uuid"] for a in attached["attachments"])
    await harness.service.detach(ADMIN, first, force=False)
    assert ("withdraw", 100) not in files.calls
    await harness.service.detach(ADMIN, second, force=False)
    assert files.calls[-1] == ("withdraw", 100)


async def test_a_refused_detach_of_the_last_gpu_keeps_the_files(
    harness: Harness, files: RecordingDriverFiles
) -> None:
    # The files go in the revoke's trip, after it: a revoke refused (in use) takes nothing.
    harness.host.spawn(100, "kernel-a")
    attached = await harness.service.attach(ADMIN, request())
    (uuid,) = (a["uuid"] for a in attached["attachments"])
    harness.injector.revoke_error = lambda: DeviceInUse([HolderInfo(100, "python")])
    with pytest.raises(Busy):
        await harness.service.detach(ADMIN, uuid, force=False)
    assert ("withdraw", 100) not in files.calls
    harness.injector.revoke_error = None
    await harness.service.detach(ADMIN, uuid, force=False)
    assert files.calls[-1] == ("withdraw", 100)


async def test_every_reconciliation_sweeps_with_the_containers_that_hold_gpus(
    harness: Harness, files: RecordingDriverFiles
) -> None:
    harness.host.spawn(100, "kernel-a")
    await harness.service.attach(ADMIN, request())
    await harness.reconciler.run_once()
    (entry,) = harness.core.allocator.all_attachments()
    assert files.swept[-1] == frozenset({entry.container})


async def test_a_reconciliation_gives_the_files_to_every_container_holding_gpus(
    harness: Harness, files: RecordingDriverFiles
) -> None:
    """A container replaced under its GPUs (restarted by the kubelet, re-injected) or one whose
    files someone took away gets them again on the next pass; one without GPUs is left."""
    harness.host.spawn(100, "kernel-a")
    harness.host.spawn(200, "kernel-b")
    await harness.service.attach(ADMIN, request())
    files.calls.clear()
    await harness.reconciler.run_once()
    assert files.calls == [("provide", 100)]


# --- CdiDriverFiles's decisions, over this process (no libcuda.so.1 on this host) -------------


def this_process() -> HostContainer:
    identity = procfs.identity(os.getpid())
    assert identity is not None
    return HostContainer(
        target=PidTarget(os.getpid(), identity.start_time),
        key=ContainerKey("this-process"),
        pid=os.getpid(),
        start_time=identity.start_time,
        cgroups=ContainerCgroups(devices_v1=None, unified=None),
        label="this process",
    )


@pytest.fixture
def no_libcuda_here() -> None:
    if any(Path(d, "libcuda.so.1").exists() for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64")):
        pytest.skip("this host has a driver: the refusal cannot be shown on it")


@pytest.mark.usefixtures("no_libcuda_here")
def test_check_mode_refuses_a_target_without_the_driver_naming_the_fix(tmp_path: Path) -> None:
    files = CdiDriverFiles(DriverFilesMode.CHECK, CdiRegistry([tmp_path]), tmp_path)
    with pytest.raises(TargetNotReady, match=r"libcuda\.so\.1") as refused:
        files.check(this_process())
    assert "NVIDIA_VISIBLE_DEVICES=none" in refused.value.message  # the fix is named


@pytest.mark.usefixtures("no_libcuda_here")
def test_cdi_mode_admits_what_the_nodes_spec_can_give_and_refuses_what_it_cannot(
    tmp_path: Path,
) -> None:
    files = CdiDriverFiles(DriverFilesMode.CDI, CdiRegistry([tmp_path / "cdi"]), tmp_path)
    with pytest.raises(TargetNotReady, match="no CDI spec"):
        files.check(this_process())
    write(tmp_path / "cdi", "nvidia.json", nvidia_spec())
    files.check(this_process())
    (tmp_path / "cdi" / "nvidia.json").write_text(json.dumps({"cdiVersion": "0.5.0"}))
    with pytest.raises(TargetNotReady, match="unreadable"):
        files.check(this_process())


def test_a_process_on_the_hosts_root_is_given_nothing_and_leaves_no_record(
    tmp_path: Path,
) -> None:
    write(tmp_path / "cdi", "nvidia.json", nvidia_spec(driver_root=str(tmp_path / "driver")))
    files = CdiDriverFiles(DriverFilesMode.CDI, CdiRegistry([tmp_path / "cdi"]), tmp_path)
    files.provide(this_process(), [DeviceNode("nvidia0", CharDevice(195, 0))])
    assert not (tmp_path / "driver-files").exists()
