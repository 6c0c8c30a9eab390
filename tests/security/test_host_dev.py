"""Attack 1: the host's ``/dev`` written through a process with a mount namespace of its own.

An unprivileged user in the socket's group runs ``unshare -Urm`` (a user and a mount
namespace of its own, the host's ``/dev`` still mounted in it) in a cgroup that is neither a
root cgroup nor the agent's, and asks for a GPU over the unix socket without a token. The
resolver compared mount-namespace identities, so the target passed; the agent then created
``/dev/nvidia0`` on the host — 0666, root-owned — or chmod-ed the host's own node, and it
stayed after the process exited. What counts is whether the target's ``/dev`` *is* the
host's: the same filesystem (the host's devtmpfs, however mounted) is refused, and so is a
``/dev`` that is not a private tmpfs at all (a chroot's ``/dev`` on a host filesystem).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.agent_process import AgentProcess
from tests.agent.api_harness import Response
from tests.fixtures.requirements import needs_root

from .helpers import REPLY_TIMEOUT, client_argv, own_cgroups, start_in, tcp, wait_for_answer

pytestmark = [*needs_root, pytest.mark.slow]

NOBODY = 65534
"""``nobody``/``nogroup``: the unprivileged user, in the socket's group."""
SYSTEM_PYTHON = Path("/usr/bin/python3")
"""An interpreter ``nobody`` may run (the test's own may live below root's home)."""
HOST_NODE = Path("/dev/nvidia0")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory ``nobody`` can enter (``tmp_path`` is root's alone): the agent's state
    dir and socket live in it, and ``out/`` takes the answer."""
    directory = Path(tempfile.mkdtemp(prefix="gpu-hotplug-sec-", dir="/tmp"))
    try:
        directory.chmod(0o755)
        (directory / "out").mkdir(mode=0o777)
        (directory / "out").chmod(0o777)
        yield directory
    finally:
        shutil.rmtree(directory)


@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="needs /usr/bin/python3")
def test_own_mount_namespace_with_the_hosts_dev_gets_no_gpu(shared_dir: Path) -> None:
    before = HOST_NODE.lstat() if HOST_NODE.exists() else None
    agent = AgentProcess(
        shared_dir / "state",
        simulate=1,
        extra_args=["--reconcile-interval=0", f"--socket-group={NOBODY}"],
    )
    agent.start()
    out = shared_dir / "out" / "answer.json"
    try:
        with own_cgroups("gpu-hotplug-sec-hostdev") as directories:
            argv = client_argv(agent.socket_path, "POST", "/v1/attachments", {"count": 1}, out)
            argv[0] = str(SYSTEM_PYTHON)
            attacker = start_in(
                directories,
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                 "unshare", "-Urm", *argv],
            )  # fmt: skip
            try:
                answer = wait_for_answer(out, agent)
            finally:
                attacker.wait(timeout=60)

        after = HOST_NODE.lstat() if HOST_NODE.exists() else None
        assert after == before, f"the host's {HOST_NODE} was made or changed: {answer}"
        assert answer["status"] == 403, answer
        assert "/dev" in answer["body"]
        gpus = tcp(agent).get("/v1/gpus").json()["gpus"]
        assert [g["state"] for g in gpus] == ["free"]
    finally:
        agent.kill9()
        if before is None and HOST_NODE.exists():
            os.unlink(HOST_NODE)  # what the attack left on the host


BUSYBOX = Path("/bin/busybox")


@pytest.mark.skipif(not BUSYBOX.exists(), reason="needs busybox-static")
def test_chroot_dev_on_a_host_filesystem_gets_no_node(tmp_path: Path) -> None:
    """A chroot with a mount namespace of its own: its ``/dev`` is a directory on a host
    filesystem, where a node the agent made would outlive the target (0666, reachable by
    any host process). Only a private tmpfs ``/dev`` gets nodes."""
    root = tmp_path / "chroot"
    (root / "bin").mkdir(parents=True)
    (root / "dev").mkdir()
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    agent = AgentProcess(tmp_path / "state", simulate=1, extra_args=["--reconcile-interval=0"])
    agent.start()
    try:
        with own_cgroups("gpu-hotplug-sec-chroot") as directories:
            target = start_in(
                directories,
                ["unshare", "-m", "--propagation", "private",
                 "chroot", str(root), "/bin/busybox", "sleep", "600"],
            )  # fmt: skip
            try:
                body = {"count": 1, "target": {"pid": target.pid}}
                answer = _once_in_own_mount_namespace(agent, target.pid, body)
            finally:
                target.kill()
                target.wait()
        assert answer.status == 403, answer.body
        assert os.listdir(root / "dev") == []
    finally:
        agent.kill9()


def _once_in_own_mount_namespace(agent: AgentProcess, pid: int, body: object) -> Response:
    """The attach, once ``pid`` has left the agent's mount namespace (``unshare`` first runs
    in ours, which the agent refuses for another reason)."""
    ours = os.stat("/proc/self/ns/mnt").st_ino
    deadline = time.monotonic() + REPLY_TIMEOUT
    while os.stat(f"/proc/{pid}/ns/mnt").st_ino == ours or not _chrooted(pid):
        assert time.monotonic() < deadline, "the target never entered its chroot"
        time.sleep(0.01)
    return tcp(agent).post("/v1/attachments", body)


def _chrooted(pid: int) -> bool:
    return os.readlink(f"/proc/{pid}/root") != "/"
