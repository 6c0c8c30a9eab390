"""Local mode end to end: the agent as a real process, sandboxes as the containers (root).

``jupyter_gpu_hotplug.agent.app --backend local --simulate 4`` runs as a subprocess over a
state dir of the test's own; sandboxes (fresh device cgroups, private ``/dev``) run the probe of
``tests/fixtures``. What a sandbox can do is the only proof that counts: opening
``/dev/nvidia<minor>`` gives ENXIO when the cgroups allow it (no driver behind the number), EPERM
when they deny it, ENOENT when there is no node. Every API answer is also checked against
``openapi.json`` by the client.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_hotplug.agent.core.checkpoints import ATTACH_STEPS, DETACH_STEPS, marker_path
from jupyter_gpu_hotplug.agent.local.ledger import Ledger
from jupyter_gpu_hotplug.linux.devrules import ALL_ACCESS, CONTAINER_DEFAULTS, char_device
from tests.fixtures.requirements import needs_cgroup_v1_devices, needs_root
from tests.fixtures.sandbox import SandboxFactory, SandboxProbe

from .agent_process import REPLY_TIMEOUT, AgentProcess, client_argv, wait_for_answer
from .api_harness import ApiClient, Response

pytestmark = [*needs_root, pytest.mark.slow]

GPUS = 4
MINORS = range(GPUS)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    process = AgentProcess(tmp_path / "state", simulate=GPUS, extra_args=["--reconcile-interval=0"])
    process.start()
    try:
        yield process
    finally:
        process.kill9()


def tcp(agent: AgentProcess) -> ApiClient:
    assert agent.tcp is not None
    return agent.tcp


def attach(agent: AgentProcess, probe: SandboxProbe, count: int = 1) -> Response:
    return tcp(agent).post("/v1/attachments", {"count": count, "target": {"pid": probe.pid}})


def usable(probe: SandboxProbe) -> set[int]:
    """The GPU minors the sandbox can open (ENXIO), testing the cgroups with nodes of our own
    where the agent made none (the container defaults allow ``mknod`` of char devices), removed
    again afterwards (a node the agent did not make is never the agent's to remove)."""
    found = set()
    for minor in MINORS:
        path = f"/dev/nvidia{minor}"
        made = probe.stat(path).result == "ENOENT"
        if made:
            assert probe.mknod(path, 195, minor) == "OK"
        result = probe.open(path)
        if made:
            assert probe.unlink(path) == "OK"
        assert result in ("ENXIO", "EPERM"), f"{path}: {result}"
        if result == "ENXIO":
            found.add(minor)
    return found


def nodes(probe: SandboxProbe) -> set[int]:
    """The GPU minors with a node in the sandbox's ``/dev``."""
    return {m for m in MINORS if probe.stat(f"/dev/nvidia{m}").result == "OK"}


def ledger_minors(agent: AgentProcess, probe: SandboxProbe) -> set[int]:
    listed = tcp(agent).get(f"/v1/attachments?pid={probe.pid}")
    assert listed.status == 200
    return {a["minor"] for a in listed.json()["attachments"]}


def run_inside(
    probe: SandboxProbe, agent: AgentProcess, method: str, path: str, body: object, out: Path
) -> dict[str, Any]:
    """One request from a process *inside* the sandbox over the unix socket, no token."""
    probe.spawn(client_argv(agent.socket_path, method, path, body, out))
    return wait_for_answer(out, agent)


# --- the basic story ------------------------------------------------------------------------


def test_attach_list_detach_over_tcp(agent: AgentProcess, sandbox: SandboxProbe) -> None:
    assert usable(sandbox) == set()

    attached = attach(agent, sandbox)

    assert attached.status == 201, attached.body
    (attachment,) = attached.json()["attachments"]
    minor = attachment["minor"]
    assert attachment["device"] == f"/dev/nvidia{minor}"
    assert attachment["target"] == {"pid": sandbox.pid}
    assert sandbox.open(f"/dev/nvidia{minor}") == "ENXIO"
    assert ledger_minors(agent, sandbox) == {minor}
    gpus = tcp(agent).get("/v1/gpus").json()["gpus"]
    assert all(g["simulated"] for g in gpus) and len(gpus) == GPUS
    assert [g["state"] for g in gpus if g["minor"] == minor] == ["attached"]

    detached = tcp(agent).delete(f"/v1/attachments/{attachment['uuid']}")

    assert detached.status == 204
    assert sandbox.stat(f"/dev/nvidia{minor}").result == "ENOENT"
    assert sandbox.mknod(f"/dev/nvidia{minor}", 195, minor) == "OK"
    assert sandbox.open(f"/dev/nvidia{minor}") == "EPERM"
    assert ledger_minors(agent, sandbox) == set()


def test_unix_socket_from_inside_the_sandbox_without_token(
    agent: AgentProcess, sandbox: SandboxProbe, tmp_path: Path
) -> None:
    out = tmp_path / "reply.json"

    attached = run_inside(sandbox, agent, "POST", "/v1/attachments", {"count": 1}, out)

    assert attached["status"] == 201, attached
    (attachment,) = json.loads(attached["body"])["attachments"]
    assert attachment["target"] == {"pid": sandbox.pid}  # the container's oldest process
    assert sandbox.open(attachment["device"]) == "ENXIO"

    listed = run_inside(sandbox, agent, "GET", "/v1/attachments", None, out)
    assert json.loads(listed["body"])["attachments"] == [attachment]

    detached = run_inside(
        sandbox, agent, "DELETE", f"/v1/attachments/{attachment['uuid']}", None, out
    )
    assert detached["status"] == 204
    assert sandbox.stat(attachment["device"]).result == "ENOENT"
    assert usable(sandbox) == set()


def test_gpu_usable_inside_only_while_attached_even_across_a_restart(
    agent: AgentProcess, sandbox: SandboxProbe
) -> None:
    minor = attach(agent, sandbox).json()["attachments"][0]["minor"]

    assert agent.stop() == 0
    agent.start()

    assert ledger_minors(agent, sandbox) == {minor}
    assert usable(sandbox) == {minor}


def test_exited_target_is_released_at_restart(
    agent: AgentProcess, sandbox_factory: SandboxFactory
) -> None:
    doomed = sandbox_factory()
    attach(agent, doomed, count=2)
    agent.kill9()
    doomed.sandbox.stop()

    agent.start()

    gpus = tcp(agent).get("/v1/gpus").json()["gpus"]
    assert [g["state"] for g in gpus] == ["free"] * GPUS


# --- concurrency ------------------------------------------------------------------------------


def test_eight_sandboxes_racing_for_four_gpus(
    agent: AgentProcess, sandbox_factory: SandboxFactory
) -> None:
    probes = [sandbox_factory() for _ in range(8)]
    start = threading.Barrier(len(probes))
    results: dict[int, Response] = {}

    def ask(probe: SandboxProbe) -> None:
        start.wait(timeout=60)
        results[probe.pid] = attach(agent, probe)

    threads = [threading.Thread(target=ask, args=(probe,)) for probe in probes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    statuses = sorted(r.status for r in results.values())
    assert statuses == [201] * 4 + [409] * 4, {p: r.body for p, r in results.items()}
    assert {r.error for r in results.values() if r.status == 409} == {"insufficient_gpus"}
    # The sandboxes themselves: every GPU usable by exactly one, and by the one the API named.
    owners: dict[int, list[int]] = {minor: [] for minor in MINORS}
    for probe in probes:
        for minor in usable(probe):
            owners[minor].append(probe.pid)
    assert all(len(pids) == 1 for pids in owners.values()), owners
    for pid, response in results.items():
        if response.status == 201:
            (attachment,) = response.json()["attachments"]
            assert owners[attachment["minor"]] == [pid]


# --- crash safety -----------------------------------------------------------------------------

# After a kill -9 at each step and a restart: is the sandbox's GPU attached (per the ledger)?
EXPECTED_AFTER_CRASH = {
    "after_reserve": False,  # reserved only: rolled back
    "after_intent": False,  # the nodes' intent recorded, the row still reserving: rolled back
    "after_grant": False,  # granted but not recorded as granted: rolled back
    "after_mark_granted": True,  # the attach was complete
    "after_begin_release": False,  # the detach was announced: finished
    "after_revoke": False,  # revoked, record not yet removed: finished
}
assert set(EXPECTED_AFTER_CRASH) == {*ATTACH_STEPS, *DETACH_STEPS}


@pytest.mark.parametrize("step", EXPECTED_AFTER_CRASH)
def test_kill_9_at_each_step_then_ledger_and_sandbox_agree(
    step: str, tmp_path: Path, sandbox: SandboxProbe
) -> None:
    agent = AgentProcess(
        tmp_path / "state",
        simulate=GPUS,
        extra_args=["--reconcile-interval=0"],
        env={"GPU_HOTPLUG_TEST_PAUSE_AT": step},
    )
    agent.start()
    try:
        if step not in ATTACH_STEPS:
            first = attach(agent, sandbox)
            assert first.status == 201
            uuid = first.json()["attachments"][0]["uuid"]
            request = threading.Thread(
                target=lambda: _ignore_errors(tcp(agent).delete, f"/v1/attachments/{uuid}")
            )
        else:
            request = threading.Thread(target=lambda: _ignore_errors(attach, agent, sandbox))
        request.start()
        marker = marker_path(agent.state_dir, step)
        deadline = time.monotonic() + REPLY_TIMEOUT
        while not marker.exists():
            assert time.monotonic() < deadline, f"never paused at {step}:\n{agent.log()}"
            time.sleep(0.02)

        agent.kill9()
        request.join(timeout=60)
        marker.unlink()
        agent.start(env={"GPU_HOTPLUG_TEST_PAUSE_AT": ""})

        recorded = ledger_minors(agent, sandbox)
        present = nodes(sandbox)
        assert usable(sandbox) == recorded
        # Killed after the node was made but before the grant was recorded ("after_grant"):
        # the intent to make it was recorded before the mknod, so the rollback knows the
        # node is the agent's and removes it — no stale node is left, nor one treated as
        # "not made by the agent" forever.
        assert present == recorded
        assert bool(recorded) is EXPECTED_AFTER_CRASH[step]
        gpus = tcp(agent).get("/v1/gpus").json()["gpus"]
        assert len(gpus) == GPUS  # no GPU lost from the pool
        assert sum(g["state"] == "attached" for g in gpus) == len(recorded)
    finally:
        agent.kill9()
    with Ledger.open(agent.state_dir) as ledger:
        assert ledger.pending() == []


def _ignore_errors(function: Any, *args: Any) -> None:
    """The request dies with the agent; its outcome is judged after the restart."""
    try:
        function(*args)
    except (ConnectionError, OSError):
        return


# --- authorization and bad input against the real agent -----------------------------------------


def test_authorization_table(
    agent: AgentProcess, sandbox_factory: SandboxFactory, tmp_path: Path
) -> None:
    mine, theirs = sandbox_factory(), sandbox_factory()
    body = {"count": 1, "target": {"pid": theirs.pid}}
    anonymous = tcp(agent).with_token(None)
    wrong = tcp(agent).with_token("not-the-token-not-the-token-not-the-tok")

    cases = {
        "tcp-no-token": anonymous.post("/v1/attachments", body),
        "tcp-wrong-token": wrong.post("/v1/attachments", body),
        "tcp-no-token-gpus": anonymous.get("/v1/gpus"),
        "unix-wrong-token": agent.unix.with_token("x" * 43).post("/v1/attachments", body),
        # This test process runs in the host's root cgroup: not a container of its own.
        "unix-host-process-itself": agent.unix.post("/v1/attachments", {"count": 1}),
    }
    inside = run_inside(mine, agent, "POST", "/v1/attachments", body, tmp_path / "reply.json")

    assert {name: r.status for name, r in cases.items()} == {
        "tcp-no-token": 401,
        "tcp-wrong-token": 401,
        "tcp-no-token-gpus": 401,
        "unix-wrong-token": 401,
        "unix-host-process-itself": 403,
    }
    assert (inside["status"], json.loads(inside["body"])["error"]) == (403, "forbidden")
    assert usable(theirs) == set() and usable(mine) == set()
    assert [g["state"] for g in tcp(agent).get("/v1/gpus").json()["gpus"]] == ["free"] * GPUS


def test_refused_targets_and_bad_input(agent: AgentProcess, sandbox: SandboxProbe) -> None:
    client = tcp(agent)
    huge = b'{"count": 1, "pad": "' + b"x" * (70 * 1024) + b'"}'

    def post(count: object, pid: int) -> Response:
        return client.post("/v1/attachments", {"count": count, "target": {"pid": pid}})

    cases = {
        "not-json": (client.post("/v1/attachments", raw=b"{nope"), 400),
        "huge-body": (client.post("/v1/attachments", raw=huge), 413),
        "zero": (post(0, sandbox.pid), 400),
        "negative": (post(-3, sandbox.pid), 400),
        # Well formed, more than the node has: the service's 409 (not retryable).
        "huge-count": (post(10**9, sandbox.pid), 409),
        "text-count": (post("1", sandbox.pid), 400),
        "unknown-field": (client.post("/v1/attachments", {"count": 1, "gpu": 0}), 400),
        "bad-uuid": (client.delete("/v1/attachments/GPU-1234"), 400),
        "pid-1": (post(1, 1), 400),
        "no-such-pid": (post(1, 4194000), 404),
        "agent-itself": (post(1, agent.pid), 403),
        "host-process": (post(1, os.getpid()), 403),
    }

    assert {name: r.status for name, (r, _) in cases.items()} == {
        name: status for name, (_, status) in cases.items()
    }
    assert usable(sandbox) == set()
    assert [g["state"] for g in client.get("/v1/gpus").json()["gpus"]] == ["free"] * GPUS


def test_metrics_and_health(agent: AgentProcess, sandbox: SandboxProbe) -> None:
    attach(agent, sandbox)
    anonymous = tcp(agent).with_token(None)

    assert anonymous.get("/healthz").json() == {"status": "ok"}
    assert anonymous.get("/metrics").status == 401
    metrics = tcp(agent).get("/metrics").body.decode()
    assert 'gpu_hotplug_attach_total{result="success"} 1.0' in metrics
    assert 'gpu_hotplug_gpus{state="attached"} 1.0' in metrics
    assert "gpu_hotplug_simulated 1.0" in metrics


# --- the node sweep (issue 38: local mode sweeps the node too) --------------------------------


def sweep_story(
    tmp_path: Path, sandbox_factory: SandboxFactory, *args: str
) -> tuple[AgentProcess, SandboxProbe, int, SandboxProbe, int]:
    """A sandbox that holds a GPU through the agent, and one whose runtime granted it another
    GPU behind the agent's back while the agent was stopped (a device rule ``c 195:N rwm`` of
    its own, written to its device cgroups as a misconfigured runtime writes it); then the
    agent started again over its ledger, whose start-up reconciliation (finished before it
    serves) sweeps the node."""
    agent = AgentProcess(
        tmp_path / "state", simulate=GPUS, extra_args=["--reconcile-interval=0", *args]
    )
    agent.start()
    kept = sandbox_factory()
    attached = attach(agent, kept)
    assert attached.status == 201, attached.body
    kept_minor = attached.json()["attachments"][0]["minor"]
    assert agent.stop() == 0
    stray_minor = max(set(MINORS) - {kept_minor})
    victim = sandbox_factory(rules=(*CONTAINER_DEFAULTS, char_device(195, stray_minor, ALL_ACCESS)))
    assert usable(victim) == {stray_minor}
    agent.start()
    return agent, kept, kept_minor, victim, stray_minor


def test_a_sandbox_granted_a_gpu_behind_the_agents_back_is_reported(
    tmp_path: Path, sandbox_factory: SandboxFactory
) -> None:
    agent, kept, kept_minor, victim, stray_minor = sweep_story(tmp_path, sandbox_factory)
    try:
        metrics = tcp(agent).get("/metrics").body.decode()
        assert "gpu_hotplug_stray_gpu_access 1.0" in metrics, "the stray, and only it"
        assert f"stray GPU access: process {victim.pid} " in agent.log()
        assert f"/dev/nvidia{stray_minor}" in agent.log().split("stray GPU access:")[1]
        assert f"stray GPU access: process {kept.pid} " not in agent.log()
        assert usable(victim) == {stray_minor}, "reported, not revoked"
        assert usable(kept) == {kept_minor}
    finally:
        agent.kill9()


@needs_cgroup_v1_devices
def test_a_sandbox_granted_a_gpu_behind_the_agents_back_is_revoked_with_the_revoke_policy(
    tmp_path: Path, sandbox_factory: SandboxFactory
) -> None:
    """v1 (or hybrid) only: a deny in ``devices.deny`` takes a runtime's rule away, while a
    runtime's own v2 program cannot be edited by the agent (a v2-only host reports it)."""
    agent, kept, kept_minor, victim, stray_minor = sweep_story(
        tmp_path, sandbox_factory, "--stray-policy=revoke"
    )
    try:
        assert usable(victim) == set(), "the stray access is revoked"
        assert usable(kept) == {kept_minor}, "the agent's own grant is kept"
        assert ledger_minors(agent, kept) == {kept_minor}
        assert "'revoked_stray'" in agent.log()
        assert f"stray GPU access: process {victim.pid} " in agent.log()
        assert f"revoked nvidia{stray_minor} from process {victim.pid} " in agent.log()
    finally:
        agent.kill9()
