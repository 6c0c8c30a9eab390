"""The injector is the one translation from the engine's errors to the core's (issue 23).

The table of ``agent/core/injector.py`` row by row, and no engine or mechanism error leaking
past ``EngineInjector``: the real engine, looking at this very process (reads only; nothing
on the host is changed), with one mechanism made to fail at a time.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR, PidTarget
from jupyter_gpu_hotplug.agent.core.injector import (
    DeviceInUse,
    EngineInjector,
    InjectionFailed,
    InjectorError,
    ScanUnfinished,
    TargetGone,
    gpu_node,
    translate,
)
from jupyter_gpu_hotplug.agent.core.seams import ContainerCgroups, ContainerKey, HostContainer
from jupyter_gpu_hotplug.linux import busy, devnodes, procfs
from jupyter_gpu_hotplug.linux import engine as host

GPU = gpu_node(3, major=NVIDIA_MAJOR)


@pytest.mark.parametrize(
    ("error", "expected", "clean"),
    [
        pytest.param(
            host.DeviceBusyError([busy.Holder(7, "python", (4,), 1000)]),
            DeviceInUse,
            None,
            id="busy",
        ),
        pytest.param(
            host.ScanTimedOut(busy.ScanTimeout(0, 9), seconds=15.0), ScanUnfinished, None, id="scan"
        ),
        pytest.param(host.TargetGoneError("process 7 has exited"), TargetGone, None, id="gone"),
        pytest.param(host.InjectionError("mknod: EPERM"), InjectionFailed, True, id="rolled-back"),
        pytest.param(
            host.InjectionError("mknod: EPERM", rollback_errors=["v1 deny: EBUSY"]),
            InjectionFailed,
            False,
            id="rollback-incomplete",
        ),
        pytest.param(
            host.EngineError("cannot read devices.list"), InjectionFailed, True, id="read"
        ),
    ],
)
def test_each_engine_error_has_one_core_error(
    error: host.EngineError, expected: type[InjectorError], clean: bool | None
) -> None:
    found = translate(error, "process 7 (python)")

    assert type(found) is expected
    if clean is not None:
        assert isinstance(found, InjectionFailed) and found.clean is clean
    if isinstance(found, DeviceInUse):
        assert [(h.pid, h.command) for h in found.holders] == [(7, "python")]
    if isinstance(found, ScanUnfinished):
        assert found.seconds == 15.0


@pytest.fixture
def injector() -> EngineInjector:
    return EngineInjector(host.HotplugEngine(control_nodes=(), systemd=None))


def this_process(*, start_time: int | None = None) -> HostContainer:
    who = procfs.identity(os.getpid())
    assert who is not None
    started = who.start_time if start_time is None else start_time
    return HostContainer(
        target=PidTarget(os.getpid(), started),
        key=ContainerKey("local:test"),
        pid=os.getpid(),
        start_time=started,
        cgroups=ContainerCgroups(devices_v1=None, unified=None),
        label=f"process {os.getpid()}",
    )


def test_a_read_of_the_real_engine_goes_through(injector: EngineInjector) -> None:
    (state,) = injector.status(this_process(), [GPU])
    assert state.device == GPU.device
    assert not state.node  # this process's /dev has no GPU here
    assert injector.holders(this_process(), [GPU]) == []


def test_a_reused_pid_is_a_gone_target(injector: EngineInjector) -> None:
    with pytest.raises(TargetGone, match="another process"):
        injector.status(this_process(start_time=1), [GPU])
    with pytest.raises(TargetGone, match="has exited"):
        injector.present(this_process(start_time=1), [GPU])


def test_present_reads_the_nodes_of_the_real_engine(injector: EngineInjector) -> None:
    assert injector.present(this_process(), [GPU]) == frozenset()  # no GPU node here


def test_a_failing_read_is_a_clean_failure_with_the_cause_chained(
    injector: EngineInjector, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreadable(pid: int, prefix: str = "nvidia", *, proc: Path = procfs.PROC) -> object:
        raise PermissionError(13, "Permission denied", f"/proc/{pid}/root/dev")

    monkeypatch.setattr(devnodes, "list_nodes", unreadable)

    with pytest.raises(InjectionFailed, match="Permission denied") as caught:
        injector.status(this_process(), [GPU])

    assert caught.value.clean
    assert isinstance(caught.value.__cause__, host.EngineError)
    assert isinstance(caught.value.__cause__.__cause__, PermissionError)


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        pytest.param(busy.ScanTimeout(3, 500), ScanUnfinished, id="deadline"),
        pytest.param(busy.ScanError((), ((9, "EACCES"),)), InjectionFailed, id="unreadable"),
    ],
)
def test_a_failing_busy_scan_is_the_cores_error(
    injector: EngineInjector,
    monkeypatch: pytest.MonkeyPatch,
    failure: busy.BusyError,
    expected: type[InjectorError],
) -> None:
    def scan(*args: object, **kwargs: object) -> object:
        raise failure

    monkeypatch.setattr(busy, "find_holders_by_device", scan)

    with pytest.raises(expected):
        injector.holders(this_process(), [GPU])
