"""Regression tests of three attacks on the agent that all came from one flaw: a pid stood in
for the container that actually holds a grant.

1. A caller's identity could be borrowed: the unix socket's peer was looked up by pid at
   request time, so a kept connection whose peer had exited acted as whatever process inherited
   the pid — in another container, without a token.
2. A GPU could be usable by a container that did not hold it: when the target process exited
   while its container lived on (or left its cgroups behind), the reconciler returned the GPU
   to the pool although the container kept the grant.
3. The agent could write to the host's ``/dev``: a target sharing the agent's mount namespace
   got its node created in the host ``/dev``, and detach deleted a host node the agent never
   created.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, PidRef
from jupyter_gpu_hotplug.agent.api.connection import peer_credentials, peer_pidfd
from jupyter_gpu_hotplug.agent.core.errors import Forbidden, InsufficientGpus, TargetNotReady
from jupyter_gpu_hotplug.agent.core.injector import InjectionFailed
from jupyter_gpu_hotplug.agent.core.seams import AttachRequest, ReservationState
from jupyter_gpu_hotplug.agent.local.identity import LocalIdentity
from jupyter_gpu_hotplug.agent.local.resolver import ProcResolver
from jupyter_gpu_hotplug.linux import cgroups, procfs
from jupyter_gpu_hotplug.linux.devrules import CharDevice
from tests.security.helpers import own_cgroups, start_in

from .api_harness import ServedAgent, UnixConnection, self_in
from .service_harness import ADMIN, Harness
from .test_reconcile import attach, node


def request(count: int, pid: int) -> AttachRequest:
    return AttachRequest(count=count, target=PidRef(pid), wait_seconds=60.0, request_id=None)


# --- 1. identity bound to the connection ---------------------------------------------------------


class _KeptConnection(UnixConnection):
    """One unix-socket connection, kept open across requests (HTTP keep-alive)."""

    def call(self, method: str, path: str) -> tuple[int, dict[str, object]]:
        self.request(method, path)
        reply = self.getresponse()
        body = reply.read()
        return reply.status, json.loads(body) if body else {}


def test_kept_connection_cannot_borrow_the_identity_of_a_reused_pid(
    served: ServedAgent,
) -> None:
    """The attack: a process of container A connects, then its pid passes to a process of
    container B (the fake host re-assigns this test process's pid, as the kernel would after A's
    process exited); a forced DELETE for B on the kept connection must not act as B."""
    victim = served.host.spawn(200, "kernel-b")
    served.tcp.post("/v1/attachments", {"count": 1, "target": {"pid": victim.pid}})
    self_in(served, "kernel-a")
    kept = _KeptConnection(served.unix.address.path, 30)  # type: ignore[union-attr]
    try:
        status, _ = kept.call("GET", "/v1/attachments")  # accepted while in kernel-a
        assert status == 200
        self_in(served, "kernel-b")  # the pid now names a process of container B

        status, body = kept.call("DELETE", f"/v1/attachments?pid={victim.pid}&force=true")

        assert (status, body["error"]) == (403, "forbidden")
        assert len(served.ledger.attachments()) == 1
        assert served.injector.usable(victim.target) == {CharDevice(195, 0)}
    finally:
        kept.close()
    # A connection accepted now is B's, and may act on B.
    assert served.unix.delete(f"/v1/attachments?pid={victim.pid}").status == 204


def test_connection_of_a_peer_gone_before_binding_has_no_container(tmp_path: Path) -> None:
    """A real peer that connects and exits before the agent binds the connection: its pid may
    already be someone else's, so the connection gets no container (only a token helps it)."""
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(1)
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"import socket; socket.socket(socket.AF_UNIX).connect({str(path)!r})",
            ],
            check=True,
        )
        accepted, _ = server.accept()
        with accepted:
            peer = peer_credentials(accepted)
            pidfd = peer_pidfd(accepted)
            resolver = ProcResolver(
                host_proc=Path("/proc"), hierarchies=cgroups.discover(), agent_pid=os.getpid()
            )
            identity = LocalIdentity("x" * 32, token_path=tmp_path / "token", resolver=resolver)
            try:
                info = identity.bind_connection(peer=peer, pidfd=pidfd)
            finally:
                if pidfd is not None:
                    os.close(pidfd)

    assert peer is not None and info.peer == peer
    assert (info.container, info.cgroups) == (None, None)


# --- 2. the owner of a grant is the container ----------------------------------------------------


async def test_target_exit_keeps_the_gpu_with_its_living_container(harness: Harness) -> None:
    """The attack: attach to a short-lived process of container A (the GPU reaches all of A),
    let it exit while A lives on, wait for the reconciler, then attach from container B."""
    kernel = harness.host.spawn(100, "kernel-a")
    harness.host.spawn(150, "kernel-a")
    await harness.service.attach(ADMIN, request(4, pid=kernel.pid))
    gpus = [entry.gpu for entry in harness.ledger.attachments()]
    harness.host.kill(100)

    report = await harness.reconciler.run_once()

    assert report.actions == {"rebound": [gpu.uuid for gpu in gpus]}
    entries = harness.ledger.attachments()
    survivor = harness.host.processes[150].target
    assert [(e.target, e.state) for e in entries] == [(survivor, ReservationState.GRANTED)] * 4
    assert harness.injector.usable(harness.host.processes[150].target) == {
        CharDevice(195, gpu.minor) for gpu in gpus
    }
    harness.host.spawn(300, "kernel-b")
    with pytest.raises(InsufficientGpus):
        await harness.service.attach(ADMIN, request(1, pid=300))
    # The container, through its remaining process, can still let go of them.
    await harness.service.detach_all(await harness.peer(150), None, force=False)
    assert harness.ledger.attachments() == []
    assert harness.injector.usable(harness.host.processes[150].target) == set()


async def test_empty_cgroups_lose_the_grant_before_the_gpu_is_released(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    gpu = await attach(harness, kernel)
    harness.host.empty_container("kernel-a")  # every process gone, the cgroups stay

    report = await harness.reconciler.run_once()

    assert report.actions == {"withdrew_remains": [gpu.uuid], "released_gone": [gpu.uuid]}
    assert harness.injector.usable(kernel.container) == set()
    assert harness.ledger.attachments() == []
    withdraw = [call for call in harness.injector.calls if call[0] == "withdraw"]
    assert withdraw == [("withdraw", 0, (CharDevice(195, gpu.minor),))]


async def test_failed_withdraw_keeps_the_reservation(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    gpu = await attach(harness, kernel)
    harness.host.empty_container("kernel-a")

    def refuse(*args: object) -> None:
        raise InjectionFailed("devices.deny: EBUSY", clean=False)

    harness.injector.withdraw = refuse  # type: ignore[method-assign,assignment]
    report = await harness.reconciler.run_once()

    assert not report.changed and report.failures
    assert [e.gpu for e in harness.ledger.attachments()] == [gpu]
    with pytest.raises(TargetNotReady, match="empty cgroups"):
        await harness.service.detach(ADMIN, GpuUuid(gpu.uuid), force=False)
    assert [e.gpu for e in harness.ledger.attachments()] == [gpu]


async def test_grant_reach_and_authorization_agree(harness: Harness) -> None:
    """A v1 grant reaches the container's cgroup and every cgroup below it, so a caller there
    counts as the container; a caller in the parent of a nested target's cgroup does not."""
    parent = harness.host.spawn(100, "kernel-a")
    harness.host.spawn(110, "kernel-a/job")
    nested = harness.host.spawn(120, "kernel-a/job")

    await harness.service.attach(await harness.peer(110), request(1, pid=parent.pid))
    with pytest.raises(Forbidden):
        await harness.service.attach(await harness.peer(100), request(1, pid=nested.pid))


# --- 3. never the host's /dev --------------------------------------------------------------------


async def test_node_the_agent_did_not_create_is_never_removed(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    # The runtime gave the container GPU 0 itself: node and permission were there first.
    harness.injector.granted.setdefault(kernel.container, set()).add(CharDevice(195, 0))
    result = await harness.service.attach(ADMIN, request(2, pid=kernel.pid))
    kept = {a["minor"]: a["uuid"] for a in result["attachments"]}
    (entry0, entry1) = harness.ledger.attachments()
    assert (entry0.node_created, entry1.node_created) == (False, True)
    revokes: list[object] = []
    real_revoke = harness.injector.revoke

    def spy(*args: object, **kwargs: object) -> None:
        revokes.append(kwargs.get("keep_nodes"))
        real_revoke(*args, **kwargs)  # type: ignore[arg-type]

    harness.injector.revoke = spy  # type: ignore[method-assign]
    await harness.service.detach(ADMIN, GpuUuid(kept[0]), force=False)
    await harness.service.detach(ADMIN, GpuUuid(kept[1]), force=False)

    assert revokes == [[node(0).name], []]


@pytest.mark.root
def test_process_in_the_host_mount_namespace_is_refused(tmp_path: Path) -> None:
    """A real process in cgroups of its own (so it passes every cgroup check) but in the
    agent's mount namespace: its /dev is the host's, so it is never a target."""
    with own_cgroups("gpu-hotplug-core-test") as directories:
        child = start_in(directories, ["sleep", "60"])
        try:
            resolver = ProcResolver(
                host_proc=Path("/proc"), hierarchies=cgroups.discover(), agent_pid=os.getpid()
            )
            _wait_until_running_in(child.pid, directories, "sleep")

            with pytest.raises(Forbidden, match="mount namespace"):
                resolver.resolve(PidRef(child.pid))
        finally:
            child.kill()
            child.wait()


def _wait_until_running_in(pid: int, directories: list[Path], comm: str) -> None:
    """Poll until ``start_in``'s shell has joined ``directories`` *and* exec'd ``comm``: the
    resolver reads the process's identity (its name among it) twice and takes a change for
    another process, which the exec between the two reads would be (seen on a loaded CI)."""
    deadline = time.monotonic() + 30

    def running() -> bool:
        joined = all(str(pid) in (d / "cgroup.procs").read_text().split() for d in directories)
        who = procfs.identity(pid)
        return joined and who is not None and who.comm == comm

    while not running():
        assert time.monotonic() < deadline, f"process {pid} never ran {comm} in {directories}"
        time.sleep(0.01)


# --- 4. one target cannot stop reconciliation ----------------------------------------------------


async def test_one_targets_unforeseen_failure_does_not_stop_the_pass(harness: Harness) -> None:
    """Whatever breaks while one target is reconciled (a RecursionError in a cgroup walk, an
    unreadable file), the pass goes on with the others and reports the failure."""
    broken = harness.host.spawn(100, "kernel-a")
    gone = harness.host.spawn(200, "kernel-b")
    await attach(harness, broken)
    gpu_b = await attach(harness, gone)
    harness.host.kill(200)
    harness.host.remove_container("kernel-b")
    real_lookup = harness.resolver.lookup

    def lookup(target: object, key: object) -> object:
        if target == broken.target:
            raise RecursionError("maximum recursion depth exceeded")
        return real_lookup(target, key)  # type: ignore[arg-type]

    harness.resolver.lookup = lookup  # type: ignore[method-assign,assignment]
    report = await harness.reconciler.run_once()

    assert report.actions == {"released_gone": [gpu_b.uuid]}
    assert len(report.failures) == 1 and "maximum recursion depth" in report.failures[0]
    assert [e.target for e in harness.ledger.attachments()] == [broken.target]
