"""Reconciliation: every state a crash or the host can leave is brought back to agreement.

The states are made the way they arise — by the allocator's own transitions and the fake host —
and each rule of ``reconcile.py`` is checked on its own, then the pass as a whole. The
reconciler sees only the seams, so every test runs twice: over the real ledger (re-loaded, as
after a restart) and over the in-memory allocator that passes the same allocator contract.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, Literal

import pytest

from jupyter_gpu_hotplug._structs import PidRef
from jupyter_gpu_hotplug.agent.core.errors import LookupFailed
from jupyter_gpu_hotplug.agent.core.hooks import BackendHooks, RunningContainer
from jupyter_gpu_hotplug.agent.core.lost import LossRules, LostGpus
from jupyter_gpu_hotplug.agent.core.reconcile import Reconciler
from jupyter_gpu_hotplug.agent.core.seams import (
    AttachRequest,
    GpuRecord,
    HostContainer,
    ReservationState,
)
from jupyter_gpu_hotplug.agent.core.sweep import NodeSweep
from jupyter_gpu_hotplug.agent.core.workers import Workers
from jupyter_gpu_hotplug.linux.devnodes import DeviceNode
from jupyter_gpu_hotplug.linux.devrules import CharDevice

from .fakes import FakeProcess, fake_gpus
from .service_harness import ADMIN, Harness, build


@pytest.fixture(params=["ledger", "memory"])
async def harness(
    request: pytest.FixtureRequest, tmp_path: Path, workers: Workers
) -> AsyncIterator[Harness]:
    built = await build(tmp_path, workers=workers, allocator=request.param)
    yield built
    built.ledger.close()


def records(harness: Harness) -> list[GpuRecord]:
    return [GpuRecord(g.uuid, g.index, g.minor, g.name) for g in harness.inventory.gpus]


def node(minor: int) -> DeviceNode:
    return DeviceNode(f"nvidia{minor}", CharDevice(195, minor))


async def reserve(harness: Harness, process: FakeProcess, *, granted: bool) -> GpuRecord:
    """A reservation as an attach leaves it when the agent dies right after ``reserve``
    (``granted=False``) or right after the host grant (``granted=True``), as the restarted
    agent reads it."""
    (entry,) = await harness.allocator.reserve(
        harness.host.host_container(process),
        1,
        request_id=None,
        deadline=math.inf,
        candidates=records(harness),
    )
    if granted:
        harness.injector.grant(harness.host.host_container(process), [node(entry.gpu.minor)])
    await harness.allocator.load()
    return entry.gpu


async def begin_release(harness: Harness, gpu: GpuRecord) -> None:
    """A detach cut short after its ledger step, as the restarted agent reads it."""
    await harness.allocator.begin_release([gpu.uuid])
    await harness.allocator.load()


async def attach(harness: Harness, process: FakeProcess) -> GpuRecord:
    result = await harness.service.attach(ADMIN, AttachRequest(1, PidRef(process.pid), 60.0, None))
    (entry,) = harness.allocator.attachments_of(process.target)
    assert entry.gpu.uuid == result["attachments"][0]["uuid"]
    return entry.gpu


@pytest.mark.parametrize("granted", [False, True], ids=["before-grant", "after-grant"])
async def test_interrupted_attach_is_rolled_back(harness: Harness, granted: bool) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    gpu = await reserve(harness, kernel, granted=granted)

    report = await harness.reconciler.run_once()

    assert report.actions == {"rolled_back_attach": [gpu.uuid]}
    assert harness.allocator.all_attachments() == []
    assert harness.injector.usable(kernel.target) == set()
    assert harness.sample("gpu_hotplug_reconcile_actions_total", action="rolled_back_attach") == 1


async def test_interrupted_attach_in_use_is_finished(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    gpu = await reserve(harness, kernel, granted=True)
    harness.injector.hold(kernel, gpu.minor, pid=101)

    report = await harness.reconciler.run_once()

    assert report.actions == {"finished_attach": [gpu.uuid]}
    (entry,) = harness.allocator.all_attachments()
    assert entry.state is ReservationState.GRANTED


@pytest.mark.parametrize("revoked", [False, True], ids=["before-revoke", "after-revoke"])
async def test_interrupted_detach_is_finished(harness: Harness, revoked: bool) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    gpu = await attach(harness, kernel)
    await begin_release(harness, gpu)
    if revoked:
        harness.injector.revoke(harness.host.host_container(kernel), [node(gpu.minor)], force=False)

    report = await harness.reconciler.run_once()

    assert report.actions == {"finished_detach": [gpu.uuid]}
    assert harness.allocator.all_attachments() == []
    assert harness.injector.usable(kernel.target) == set()


async def test_interrupted_detach_in_use_is_cancelled(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    gpu = await attach(harness, kernel)
    await begin_release(harness, gpu)
    harness.injector.hold(kernel, gpu.minor, pid=101)

    report = await harness.reconciler.run_once()

    assert report.actions == {"cancelled_release": [gpu.uuid]}
    (entry,) = harness.allocator.all_attachments()
    assert entry.state is ReservationState.GRANTED
    assert harness.injector.usable(kernel.target) == {CharDevice(195, gpu.minor)}


async def test_lost_grant_is_granted_again(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    gpu = await attach(harness, kernel)
    harness.injector.granted.clear()  # e.g. systemd re-applied the unit's device list

    report = await harness.reconciler.run_once()

    assert report.actions == {"regranted": [gpu.uuid]}
    assert harness.injector.usable(kernel.target) == {CharDevice(195, gpu.minor)}


async def test_removed_container_is_released(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    gpu = await attach(harness, kernel)
    harness.host.remove_container("kernel-a")

    report = await harness.reconciler.run_once()

    assert report.actions == {"released_gone": [gpu.uuid]}
    assert harness.allocator.all_attachments() == []


async def test_a_container_that_cannot_be_looked_up_keeps_its_gpu(harness: Harness) -> None:
    """The runtime or the API server does not answer: not known to be gone, so nothing is
    released or withdrawn; the next pass that can tell finds everything as it was."""
    kernel = harness.host.spawn(100, "kernel-a")
    gpu = await attach(harness, kernel)
    harness.resolver.unanswered = True

    report = await harness.reconciler.run_once()

    assert report.actions == {}
    unanswered = LookupFailed(f"{kernel.target}: the container runtime did not answer")
    assert report.failures == [f"{kernel.target}: cannot be looked up now: {unanswered}"]
    assert [e.gpu.uuid for e in harness.allocator.attachments_of(kernel.target)] == [gpu.uuid]
    assert harness.injector.usable(kernel.target) == {CharDevice(195, gpu.minor)}

    harness.resolver.unanswered = False
    assert (await harness.reconciler.run_once()).actions == {}


async def test_reused_pid_is_another_process(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    gpu = await attach(harness, kernel)
    harness.host.remove_container("kernel-a")
    newcomer = harness.host.spawn(100, "kernel-z")

    report = await harness.reconciler.run_once()

    assert report.actions == {"released_gone": [gpu.uuid]}
    assert harness.injector.usable(newcomer.target) == set()


async def test_unrecorded_access_is_revoked(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    mine = await attach(harness, kernel)
    harness.injector.granted[kernel.container].add(CharDevice(195, 3))

    report = await harness.reconciler.run_once()

    assert report.actions == {"revoked_unrecorded": [harness.inventory.gpus[3].uuid]}
    assert harness.injector.usable(kernel.target) == {CharDevice(195, mine.minor)}


@pytest.mark.parametrize("allocator", ["ledger", "memory"])
async def test_a_device_plugins_gpu_is_never_unrecorded(
    tmp_path: Path, workers: Workers, allocator: Literal["ledger", "memory"]
) -> None:
    """Issue 21: a pod that got a GPU from the device plugin and hot-attaches another keeps
    the plugin's (the backend says which: ``BackendHooks.assigned``, given to the core when
    it is built)."""
    plugin = fake_gpus(4)[3]
    hooks = BackendHooks(assigned=lambda container: {plugin.uuid} if container.pid == 100 else ())
    harness = await build(tmp_path, workers=workers, allocator=allocator, hooks=hooks)
    try:
        kernel = harness.host.spawn(100, "kernel-a")
        mine = await attach(harness, kernel)
        harness.injector.granted[kernel.container].add(CharDevice(195, plugin.minor))

        report = await harness.reconciler.run_once()

        assert not report.changed
        assert harness.injector.usable(kernel.target) == {
            CharDevice(195, mine.minor),
            CharDevice(195, plugin.minor),
        }
    finally:
        harness.ledger.close()


async def test_two_targets_in_one_container_keep_their_own(harness: Harness) -> None:
    first = harness.host.spawn(100, "kernel-a")
    second = harness.host.spawn(101, "kernel-a")
    gpus = [await attach(harness, first), await attach(harness, second)]

    report = await harness.reconciler.run_once()

    assert not report.changed
    assert harness.injector.usable(first.target) == {CharDevice(195, g.minor) for g in gpus}


async def test_agreement_changes_nothing(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    await attach(harness, kernel)
    calls = len(harness.injector.calls)

    report = await harness.reconciler.run_once()

    assert not report.changed
    assert report.failures == []
    assert len(harness.injector.calls) == calls


async def test_targets_with_an_operation_in_flight_are_skipped(harness: Harness) -> None:
    kernel = harness.host.spawn(100, "kernel-a")
    gpu = await reserve(harness, kernel, granted=True)

    async with harness.core.locks.operation(kernel.target):
        report = await harness.reconciler.run_once()

    assert report.skipped_busy == [kernel.target.key]
    assert not report.changed
    (entry,) = harness.allocator.all_attachments()
    assert (entry.gpu, entry.state) == (gpu, ReservationState.RESERVING)


async def test_replaced_container_gets_the_gpu_and_the_reservation(harness: Harness) -> None:
    """The Kubernetes case, through the same seams: the target's container was replaced (a
    restart: a new key); the GPU is granted to the new container and the reservation follows."""
    kernel = harness.host.spawn(100, "kernel-a")
    gpu = await attach(harness, kernel)
    harness.host.remove_container("kernel-a")
    successor = harness.host.spawn(200, "kernel-a")  # same cgroups, a new container
    harness.resolver.replacements[kernel.target.key] = successor.pid

    report = await harness.reconciler.run_once()

    assert report.actions == {"reinjected": [gpu.uuid]}
    (entry,) = harness.allocator.all_attachments()
    assert (entry.target, entry.container) == (
        successor.target,
        harness.host.key_of(successor.container),
    )
    assert harness.injector.calls[-1] == ("grant", successor.pid, (CharDevice(195, gpu.minor),))
    assert harness.injector.usable(successor.target) == {CharDevice(195, gpu.minor)}


async def _swept(
    tmp_path: Path, workers: Workers, running: list[HostContainer], *, orphans: bool
) -> tuple[Harness, NodeSweep, list[Coroutine[Any, Any, None]]]:
    """A service whose backend lists ``running`` as the node's containers, and a node sweep
    over it whose loss sequences (no grace) are collected, not run."""
    hooks = BackendHooks(
        running=lambda reservations: [RunningContainer(c) for c in running], orphans=orphans
    )
    harness = await build(tmp_path, workers=workers, hooks=hooks)
    spawned: list[Coroutine[Any, Any, None]] = []
    lost = LostGpus(
        rules=LossRules(grace_seconds=0), book=harness.core.losses, metrics=harness.metrics
    )
    sweep = NodeSweep(
        harness.core,
        revoker=harness.service.revoker,
        lost=lost,
        revoke_strays=False,
        spawn=spawned.append,
    )
    return harness, sweep, spawned


async def test_the_node_sweep_takes_an_orphan_back_through_the_loss_sequence(
    tmp_path: Path, workers: Workers
) -> None:
    """Issue 38: the one node sweep of the core, over a backend's ``running`` containers. A
    container that can open a grant of ours no reservation backs (its reservation gone while
    the agent was down) is an orphan: announced, then revoked by the loss sequence; a
    container holding its GPU through the agent is accounted and keeps it."""
    running: list[HostContainer] = []
    harness, sweep, spawned = await _swept(tmp_path, workers, running, orphans=True)
    try:
        kernel = harness.host.spawn(100, "kernel-a")
        mine = await attach(harness, kernel)
        orphaned = harness.host.spawn(200, "kernel-b")
        harness.injector.grant(harness.host.host_container(orphaned), [node(3)])
        running += [harness.host.host_container(p) for p in (kernel, orphaned)]

        report = await Reconciler(harness.core, sweep=sweep).run_once()

        assert report.actions == {"orphan_found": [harness.inventory.gpus[3].uuid]}
        assert harness.injector.usable(orphaned.target) == {CharDevice(195, 3)}, "told first"
        (sequence,) = spawned
        await sequence
        assert harness.injector.usable(orphaned.target) == set()
        assert harness.sample("gpu_hotplug_lost_revokes_total", kind="orphan") == 1.0
        assert harness.injector.usable(kernel.target) == {CharDevice(195, mine.minor)}
        assert harness.sample("gpu_hotplug_stray_gpu_access") == 0.0
    finally:
        harness.ledger.close()


async def test_where_grants_cannot_outlive_reservations_an_unbacked_grant_is_a_stray(
    tmp_path: Path, workers: Workers
) -> None:
    """Local mode (``BackendHooks.orphans`` False): the ledger drops a row only after the
    revoke, so a grant that looks like the agent's but that no row backs is somebody else's —
    another agent's, or NVIDIA's legacy runtime hook, which writes the same ``c 195:N rw`` on
    cgroup v1. It is reported as a stray and left alone (the default stray policy); it never
    goes through the loss sequence that takes an orphan back."""
    running: list[HostContainer] = []
    harness, sweep, spawned = await _swept(tmp_path, workers, running, orphans=False)
    try:
        other = harness.host.spawn(200, "docker-gpus")
        harness.injector.grant(harness.host.host_container(other), [node(3)])
        running.append(harness.host.host_container(other))

        report = await Reconciler(harness.core, sweep=sweep).run_once()

        assert report.actions == {"stray_found": [harness.inventory.gpus[3].uuid]}
        assert spawned == []
        assert harness.injector.usable(other.target) == {CharDevice(195, 3)}
        assert harness.sample("gpu_hotplug_stray_gpu_access") == 1.0
    finally:
        harness.ledger.close()
