"""A sandbox is a boundary between kernels (issue 9): a root workload inside cannot read the
agent's token, cannot leave its device cgroup, and holds only Docker's default capabilities.

Each test runs a real local agent and a real sandbox whose workload is a Python script that
tries the attacks a red team tried, as root, and reports what the kernel answered. Before this
issue a sandboxed root process held nearly every capability, read the token through the
filesystem or ``/proc/<agent>/root``, and could write itself into the root device cgroup.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from jupyter_gpu_hotplug.linux import cgroups
from jupyter_gpu_hotplug.linux.sandbox.runtime import DOCKER_DEFAULT_CAPABILITIES
from tests.fixtures.agent import LocalAgent
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxFactory

pytestmark = [*needs_root]

# Runs inside the sandbox (python -I -S): each attack's outcome, as JSON on stdout.
ATTACKS = r"""
import ctypes, errno, json, os, sys
args = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
out = {}

def attempt(name, action):
    try:
        result = action()
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
    else:
        out[name] = "ok" if result is None else result

def read(path):
    with open(path, "rb") as f:
        return "read %d bytes" % len(f.read())

def write(path, data):
    with open(path, "w") as f:
        f.write(data)

def libc_call(name, *argv):
    if getattr(libc, name)(*argv) != 0:
        raise OSError(ctypes.get_errno(), name)

attempt("token", lambda: read(args["token"]))
attempt("token_via_agent_root", lambda: read("/proc/%d/root%s" % (args["agent"], args["token"])))
attempt("ledger_listing", lambda: sorted(os.listdir(args["state"])) or None)
for name, procs in args["cgroup_procs"].items():
    attempt("leave_" + name, lambda procs=procs: write(procs, str(os.getpid())))
if "v1_mount" in args:
    for line in open("/proc/self/cgroup").read().splitlines():
        number, controllers, path = line.split(":", 2)
        if "devices" in controllers.split(","):
            own = args["v1_mount"] + path + "/devices.allow"
            attempt("allow_own", lambda: write(own, "a *:* rwm"))
for name, mount_point in args["mounts"].items():
    attempt("umount_" + name, lambda p=mount_point: libc_call("umount2", p.encode(), 2))
    attempt(
        "remount_rw_" + name,
        lambda p=mount_point: libc_call("mount", b"none", p.encode(), None, 0x20 | 0x1000, None),
    )
attempt("write_etc", lambda: write("/etc/gpu-hotplug-sandbox-test", "x"))
attempt("write_sysctl", lambda: write("/proc/sys/kernel/core_pattern", "|/tmp/x"))
attempt("write_own_comm", lambda: write("/proc/self/comm", "renamed"))
attempt("write_cwd", lambda: write("owned-by-me", "x"))
attempt("write_tmp", lambda: write(args["tmp_file"], "x"))
attempt("mknod_gpu", lambda: os.mknod("/dev/nvidia0", 0o20666, os.makedev(195, 0)))
attempt("open_gpu", lambda: os.close(os.open("/dev/nvidia0", os.O_RDWR)))
lines = open("/proc/self/status").read().splitlines()
status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
out["CapEff"] = int(status["CapEff"], 16)
out["CapBnd"] = int(status["CapBnd"], 16)
print(json.dumps(out))
"""


def _attack(sandbox_factory: SandboxFactory, agent: LocalAgent, work: Path) -> dict[str, Any]:
    found = cgroups.discover()
    args: dict[str, Any] = {
        "token": str(agent.token_path),
        "state": str(agent.token_path.parent),
        "agent": agent.pid,
        "cgroup_procs": {},
        "mounts": {},
        "tmp_file": str(work.parent / "written-in-tmp"),
    }
    if found.devices_v1 is not None:
        args["v1_mount"] = str(found.devices_v1.mount_point)
        args["cgroup_procs"]["v1"] = str(found.devices_v1.mount_point / "cgroup.procs")
        args["mounts"]["v1"] = str(found.devices_v1.mount_point)
    if found.unified is not None:
        args["cgroup_procs"]["v2"] = str(found.unified.mount_point / "cgroup.procs")
        args["mounts"]["v2"] = str(found.unified.mount_point)
    sandbox = sandbox_factory.raw(
        (sys.executable, "-I", "-S", "-c", ATTACKS, json.dumps(args)),
        stdout=subprocess.PIPE,
        cwd=str(work),
        hidden=(str(agent.token_path.parent),),
    )
    assert sandbox.stdout is not None
    output = sandbox.stdout.read()
    assert sandbox.wait(timeout=60) == 0
    result: dict[str, Any] = json.loads(output)
    return result


def test_a_sandboxed_root_process_cannot_read_the_token_nor_leave_its_cgroup(
    sandbox_factory: SandboxFactory, local_agent: LocalAgent, tmp_path: Path
) -> None:
    work = tmp_path / "notebooks"
    work.mkdir()

    seen = _attack(sandbox_factory, local_agent, work)

    # The agent's state directory is an empty tmpfs; its own root is out of reach.
    assert seen["token"] == "ENOENT"
    # ... and the agent cannot even be named: the sandbox has a pid namespace of its own.
    assert seen["token_via_agent_root"] == "ENOENT"
    assert seen["ledger_listing"] == "ok"  # empty
    # The cgroup filesystems are read-only and cannot be unmounted or made writable.
    assert "allow_own" in seen or cgroups.discover().devices_v1 is None
    for key in [k for k in seen if k.startswith(("leave_", "allow_"))]:
        assert seen[key] == "EROFS", key
    for key in [k for k in seen if k.startswith(("umount_", "remount_rw_"))]:
        assert seen[key] == "EPERM", key
    # So a GPU node it makes itself stays unusable: the device cgroup still says no.
    assert (seen["mknod_gpu"], seen["open_gpu"]) == ("ok", "EPERM")
    # Docker's capabilities, no more, in the bounding set too.
    docker = sum(1 << cap for cap in DOCKER_DEFAULT_CAPABILITIES)
    assert (seen["CapEff"], seen["CapBnd"]) == (docker, docker)
    # Read-only but for what it owns: its working directory and /tmp.
    assert seen["write_etc"] == "EROFS"
    assert seen["write_sysctl"] == "EROFS"  # the host's kernel settings, as in Docker
    assert seen["write_own_comm"] == "ok"  # but its own /proc entries, as in Docker
    assert (seen["write_cwd"], seen["write_tmp"]) == ("ok", "ok")
    assert (work / "owned-by-me").read_text() == "x"
    # The agent's files are untouched.
    assert local_agent.token_path.read_text().strip() == local_agent.token
