"""busy: finding the processes that hold a device open, and ending them.

The held device is ``/dev/zero`` (c 1:5): a ``c 195:N`` node cannot be held open
without the NVIDIA driver, and the scan only compares ``st_rdev``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from jupyter_gpu_hotplug.linux import busy
from jupyter_gpu_hotplug.linux.busy import Holder, ScanError
from jupyter_gpu_hotplug.linux.devrules import CharDevice

from ..fixtures.requirements import needs_cgroup_v1_devices, needs_root
from .probes import PROBE_COMM, move_into, probe, scratch_v1_cgroup

ZERO = CharDevice(1, 5)
ZERO_PATH = Path("/dev/zero")


def reaped_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def test_holder_reported_with_pid_comm_and_fd() -> None:
    with probe() as child:
        assert busy.holders_among([child.pid], ZERO) == []
        fd = child.hold_fd(ZERO_PATH)
        [holder] = busy.holders_among([child.pid, reaped_pid()], ZERO)
        assert (holder.pid, holder.comm, holder.fds) == (child.pid, PROBE_COMM, (fd,))
        assert busy.holders_among([child.pid], CharDevice(1, 3)) == []


def test_several_devices_in_one_scan() -> None:
    null, full = CharDevice(1, 3), CharDevice(1, 7)
    asked: list[CharDevice] = []

    def nvml(device: CharDevice) -> list[int]:
        asked.append(device)
        return [second.pid] if device == full else []

    with probe() as first, probe() as second:
        zero_fd = first.hold_fd(ZERO_PATH)
        null_fd = first.hold_fd(Path("/dev/null"))
        second_null_fd = second.hold_fd(Path("/dev/null"))

        found = busy.holders_by_device(
            [first.pid, second.pid, reaped_pid()], [ZERO, null, full], extra_holders=nvml
        )

        assert {device: [(h.pid, h.fds) for h in holders] for device, holders in found.items()} == {
            ZERO: [(first.pid, (zero_fd,))],
            null: sorted([(first.pid, (null_fd,)), (second.pid, (second_null_fd,))]),
            full: [(second.pid, ())],
        }
        assert asked == [ZERO, null, full]
        assert found[null] == busy.holders_among([first.pid, second.pid], null)


def test_extra_source_counts_only_the_scanned_pids() -> None:
    asked: list[CharDevice] = []

    def nvml(device: CharDevice) -> list[int]:
        asked.append(device)
        return [child.pid, os.getpid()]

    with probe() as child:
        [holder] = busy.holders_among([child.pid], ZERO, extra_holders=nvml)
        assert (holder.pid, holder.comm, holder.fds) == (child.pid, PROBE_COMM, ())
        assert asked == [ZERO]


def test_terminate_ends_a_holder_with_sigterm() -> None:
    with probe() as child:
        child.hold_fd(ZERO_PATH)
        holders = busy.holders_among([child.pid], ZERO)
        result = busy.terminate(holders, grace=60.0)
        assert result == busy.Termination(exited=(child.pid,), killed=(), survivors=(), vanished=())
        assert result.all_gone
        assert child.process.wait() == -signal.SIGTERM


def test_terminate_kills_a_holder_that_ignores_sigterm() -> None:
    with probe() as child:
        child.hold_fd(ZERO_PATH)
        assert child.ignore_term() == "OK"
        holders = busy.holders_among([child.pid], ZERO)
        result = busy.terminate(holders, grace=0.2, kill_wait=60.0)
        assert (result.exited, result.killed, result.survivors) == ((), (child.pid,), ())
        assert child.process.wait() == -signal.SIGKILL


def test_terminate_never_signals_a_different_process_with_the_pid() -> None:
    with probe() as child:
        [holder] = busy.holders_among([child.pid], ZERO, extra_holders=lambda _: [child.pid])
        impostor = Holder(holder.pid, holder.comm, holder.fds, holder.start_time - 1)
        gone = Holder(reaped_pid(), "gone", (), 0)
        result = busy.terminate([impostor, gone])
        assert result.vanished == tuple(sorted((child.pid, gone.pid)))
        assert child.ignore_term() == "OK"  # still alive and answering


class TestAsRoot:
    pytestmark = needs_root

    @needs_cgroup_v1_devices
    def test_find_holders_in_a_container_cgroup(self) -> None:
        with scratch_v1_cgroup() as top, probe() as inside, probe() as outside:
            leaf = top / "container"
            leaf.mkdir()
            move_into(leaf, inside.pid)
            fd = inside.hold_fd(ZERO_PATH)
            outside.hold_fd(ZERO_PATH)
            holders = busy.find_holders([top], ZERO)
            assert [(h.pid, h.comm, h.fds) for h in holders] == [(inside.pid, PROBE_COMM, (fd,))]
            null = CharDevice(1, 3)
            assert busy.find_holders_by_device([top], [ZERO, null]) == {ZERO: holders, null: []}

    def test_uninspectable_process_is_reported_not_skipped(self) -> None:
        with probe() as child:
            fd = child.hold_fd(ZERO_PATH)
            read, write = os.pipe()
            scanner = os.fork()
            if scanner == 0:  # a scan without the right to look at a root process's fds
                os.close(read)
                try:
                    os.setuid(65534)
                    busy.holders_among([child.pid], ZERO)
                    report = "no error"
                except ScanError as e:
                    report = f"{[pid for pid, _ in e.unreadable]} {e}"
                except BaseException as e:
                    report = f"unexpected {e!r}"
                os.write(write, report.encode())
                os._exit(0)
            os.close(write)
            with os.fdopen(read) as pipe:
                report = pipe.read()
            os.waitpid(scanner, 0)
            assert report.startswith(f"[{child.pid}] cannot inspect"), report
            assert "Permission denied" in report
            assert busy.holders_among([child.pid], ZERO)[0].fds == (fd,)
