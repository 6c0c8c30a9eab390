"""busy: finding the processes that hold a device open, and ending them.

The held device is ``/dev/zero`` (c 1:5): a ``c 195:N`` node cannot be held open
without the NVIDIA driver, and the scan only compares ``st_rdev``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jupyter_gpu_hotplug.linux import busy
from jupyter_gpu_hotplug.linux.busy import Holder, ScanError, ScanTimeout
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


# --- issue 25: a device fd parked in a socket, and a scan that would take too long -------------

_PARK = """
import os, socket, sys
fd = os.open("/dev/zero", os.O_RDONLY)
kind = sys.argv[1]
if kind == "stream":
    # Both ends stay open: the fd sits in the receiving end's queue.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    socket.send_fds(mine, [b"x"], [fd])
elif kind == "datagram":
    # A message of no bytes, and the sending end closed: only the queue holds the fd.
    theirs, mine = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    socket.send_fds(mine, [b""], [fd])
    mine.close()
elif kind == "drained":
    # Sent and received: the fd is back in the fd table, then closed; nothing is queued.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    socket.send_fds(mine, [b"x"], [fd])
    _, fds, _, _ = socket.recv_fds(theirs, 1, 1)
    os.close(fds[0])
else:
    # Sent through a connection the process has not accepted yet, both client ends closed.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(b"\\0" + os.urandom(8).hex().encode())
    listener.listen(1)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(listener.getsockname())
    socket.send_fds(client, [b"x"], [fd])
    client.close()
os.close(fd)
print("parked", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _parked(kind: str) -> Iterator[int]:
    """A process that did ``kind`` (see ``_PARK``) with its fd of ``/dev/zero``; its pid."""
    with subprocess.Popen(
        [sys.executable, "-c", _PARK, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"parked\n"
            yield child.pid
        finally:
            child.kill()


@pytest.mark.parametrize("kind", ["stream", "datagram", "unaccepted"])
def test_a_device_fd_parked_in_a_socket_is_held(kind: str) -> None:
    """Attack (issue 25, item 8): a process sends its fd of the device through a unix socket
    of its own (SCM_RIGHTS) and closes it: ``/proc/<pid>/fd`` shows no fd of the device, the
    detach said "not busy", and the process took the fd back once the GPU was another's. A
    process with a message queued on a unix socket it holds (sent or not yet received, even
    one of no bytes, even on a connection not yet accepted) may hold any device that way: it
    counts as a holder."""
    with _parked(kind) as pid:
        [holder] = busy.holders_among([pid], ZERO)

        assert holder.pid == pid
        assert holder.fds == () and holder.queued != ()


def test_a_socket_with_nothing_queued_holds_nothing() -> None:
    with _parked("drained") as pid:
        assert busy.holders_among([pid], ZERO) == []


def test_a_scan_past_its_deadline_stops_and_says_how_far_it_got() -> None:
    """Issue 25: a detach of a container with 500 processes x 2,000 fds took 25-45 s; the scan
    has a deadline and stops there (the caller answers 503 with retry_after)."""
    with probe() as first, probe() as second:
        with pytest.raises(ScanTimeout) as stopped:
            busy.holders_by_device([first.pid, second.pid], [ZERO], deadline=time.monotonic())

        assert (stopped.value.scanned, stopped.value.total) == (0, 2)
        assert "0 of 2 processes" in str(stopped.value)
