"""Attack 4: a sandboxed kernel freezes or kills the agent.

Local mode's sandboxes shared the host's pid namespace, ran their kernels as uid 0 and had
no seccomp filter: a kernel's ``os.kill(<agent pid>, SIGSTOP)`` froze the agent, and
``unshare(CLONE_NEWUSER)`` gave it a user namespace where it holds every capability. A
sandbox must look like a container from inside: a pid namespace of its own (the kernel's
process tree only: nothing outside can be named, so nothing outside can be signalled) and
Docker's default seccomp restrictions (no ``unshare``, ``setns``, ``mount``, ``bpf``,
``ptrace``, module or kexec loading...).

The attacks run as a script inside a real sandbox next to a real agent; only the agent pid is
aimed at (never ``kill(-1)``, which would stop every process of an unfixed host).
"""

from __future__ import annotations

import json
import platform
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.agent import LocalAgent
from tests.fixtures.requirements import needs_root
from tests.fixtures.sandbox import SandboxFactory

pytestmark = [*needs_root, pytest.mark.slow]

ATTACKS = r"""
import ctypes, errno, json, os, signal, sys
args = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}

def attempt(name, action):
    try:
        result = action()
        out[name] = "ok" if result in (None, 0) else result
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))

def call(function, *call_args):
    if function(*call_args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))

def syscall(number, *call_args):
    call(libc.syscall, ctypes.c_long(number), *call_args)

agent = args["agent"]
attempt("stop_agent", lambda: os.kill(agent, signal.SIGSTOP))
attempt("see_agent", lambda: os.stat(f"/proc/{agent}") and None)
out["pids_visible"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
out["own_pid"] = os.getpid()
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID = 0x20000, 0x10000000, 0x20000000
attempt("unshare_user", lambda: call(libc.unshare, CLONE_NEWUSER))
attempt("unshare_user_mount", lambda: call(libc.unshare, CLONE_NEWUSER | CLONE_NEWNS))
attempt("unshare_pid", lambda: call(libc.unshare, CLONE_NEWPID))
attempt("setns", lambda: call(libc.setns, os.open("/proc/self/ns/mnt", os.O_RDONLY), 0))
attempt("mount", lambda: call(libc.mount, b"none", b"/tmp", b"tmpfs", 0, None))
attempt("bpf", lambda: syscall(args["nr"]["bpf"], 0, None, 0))
attempt("ptrace_traceme", lambda: call(libc.ptrace, 0, 0, None, None))
attempt("init_module", lambda: syscall(args["nr"]["init_module"], None, 0, b""))
attempt("kexec_load", lambda: syscall(args["nr"]["kexec_load"], 0, 0, None, 0))
status = dict(
    line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line
)
out["Seccomp"] = status.get("Seccomp", "").strip()
print(json.dumps(out), flush=True)
"""

SYSCALLS = {
    "x86_64": {"bpf": 321, "init_module": 175, "kexec_load": 246},
    "aarch64": {"bpf": 280, "init_module": 105, "kexec_load": 104},
}


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_sandboxed_kernel_can_neither_signal_the_agent_nor_escape_its_namespaces(
    sandbox_factory: SandboxFactory, local_agent: LocalAgent
) -> None:
    numbers = SYSCALLS.get(platform.machine())
    if numbers is None:
        pytest.skip(f"no syscall numbers for {platform.machine()}")
    args = {"agent": local_agent.pid, "nr": numbers}
    sandbox = sandbox_factory.raw(
        (sys.executable, "-I", "-S", "-c", ATTACKS, json.dumps(args)), stdout=subprocess.PIPE
    )
    assert sandbox.stdout is not None
    try:
        seen: dict[str, Any] = json.loads(sandbox.stdout.read())
        assert sandbox.wait(timeout=60) == 0
        stopped = _state(local_agent.pid) == "T"
    finally:
        local_agent.process.send_signal(signal.SIGCONT)  # whatever the attack did

    assert not stopped, "a sandboxed process stopped the agent"
    assert seen["stop_agent"] == "ESRCH", seen
    assert seen["see_agent"] == "ENOENT", seen
    # Its own pid namespace: it sees only its sandbox's processes (an init and itself).
    assert len(seen["pids_visible"]) <= 3 and seen["own_pid"] in seen["pids_visible"], seen
    # Docker's default seccomp restrictions, as a filter (mode 2).
    assert seen["Seccomp"] == "2", seen
    for name in ("unshare_user", "unshare_user_mount", "unshare_pid", "setns", "mount",
                 "bpf", "ptrace_traceme", "init_module", "kexec_load"):  # fmt: skip
        assert seen[name] == "EPERM", (name, seen)
