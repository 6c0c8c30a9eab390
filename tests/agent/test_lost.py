"""The loss sequence (``core/lost.py``): the user is told before anything is touched, the
access goes after the grace period, processes are ended only by the ``force`` policy, a
caller's operation in flight is waited for, and one loss is handled once. Against the
service harness's in-memory host and a real ledger."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, PidRef
from jupyter_gpu_hotplug.agent.core import lost as lost_module
from jupyter_gpu_hotplug.agent.core.hooks import BackendHooks
from jupyter_gpu_hotplug.agent.core.injector import HolderInfo, InjectionFailed
from jupyter_gpu_hotplug.agent.core.lost import (
    LossNotice,
    LossRules,
    LostGpus,
    LostPolicy,
    TakeBack,
)
from jupyter_gpu_hotplug.agent.core.seams import AttachRequest, Reservation
from jupyter_gpu_hotplug.agent.core.workers import Workers
from jupyter_gpu_hotplug.linux.devrules import CharDevice

from .service_harness import ADMIN, Harness, built


async def _attached(harness: Harness, pid: int = 100) -> Reservation:
    harness.host.spawn(pid, f"kernel-{pid}")
    answer = await harness.service.attach(
        ADMIN, AttachRequest(count=1, target=PidRef(pid), wait_seconds=60, request_id=None)
    )
    entry = harness.allocator.get(GpuUuid(answer["attachments"][0]["uuid"]))
    assert entry is not None
    return entry


def _lost(harness: Harness, policy: LostPolicy, grace: float) -> LostGpus:
    return LostGpus(
        rules=LossRules(grace_seconds=grace, policy=policy),
        book=harness.core.losses,
        metrics=harness.metrics,
    )


@pytest.mark.parametrize("policy", list(LostPolicy))
async def test_told_first_then_revoked_and_only_force_ends_processes(
    tmp_path: Path, workers: Workers, policy: LostPolicy
) -> None:
    """The backend's listeners (its hooks, given to the core when it is built) hear of the
    loss before anything is touched, then of what was done."""
    heard: list[tuple[LossNotice, TakeBack | None]] = []
    seen_usable: list[bool] = []

    def listener(notice: LossNotice, outcome: TakeBack | None) -> None:
        heard.append((notice, outcome))
        if outcome is None:  # at the announcement nothing is touched yet
            seen_usable.append(
                device in harness.injector.usable(harness.host.processes[100].target)
            )
            assert list(harness.core.losses.notices) == [entry.gpu.uuid]

    hooks = BackendHooks(loss_listeners=(listener,))
    async with built(tmp_path, workers, hooks=hooks) as harness:
        entry = await _attached(harness)
        device = CharDevice(195, entry.gpu.minor)
        harness.injector.hold(harness.host.processes[100], entry.gpu.minor, pid=4242)
        lost = _lost(harness, policy, grace=0)

        async def revoke(force: bool) -> TakeBack | None:
            return await harness.service.revoker.take_back(entry, force=force)

        await lost.handle(
            key="h", target=entry.target, gpus=[entry.gpu], reason="evicted", revoke=revoke
        )

        assert seen_usable == [True]
        assert [outcome is None for _, outcome in heard] == [True, False]
        outcome = heard[-1][1]
        assert outcome is not None
        assert outcome.forced is (policy is LostPolicy.FORCE)
        assert outcome.still_open == (
            () if policy is LostPolicy.FORCE else (HolderInfo(4242, "python"),)
        )
        assert device not in harness.injector.usable(harness.host.processes[100].target)
        assert [h.pid for h in harness.injector.forced] == (
            [4242] if policy is LostPolicy.FORCE else []
        )
        assert harness.allocator.get(entry.gpu.uuid) is None
        assert harness.core.losses.notices == {}
        assert harness.sample("gpu_hotplug_lost_revokes_total", kind="holder") == 1


async def test_the_notice_is_on_the_attachment_during_the_grace_period(harness: Harness) -> None:
    entry = await _attached(harness)
    lost = _lost(harness, LostPolicy.REVOKE, grace=3600)

    async def revoke(force: bool) -> TakeBack | None:
        return await harness.service.revoker.take_back(entry, force=force)

    task = asyncio.ensure_future(
        lost.handle(key="h", target=entry.target, gpus=[entry.gpu], reason="evicted", revoke=revoke)
    )
    while entry.gpu.uuid not in harness.core.losses.notices:
        await asyncio.sleep(0)
    assert lost.pending("h")
    (shown,) = (await harness.service.attachments(ADMIN, PidRef(100)))["attachments"]
    assert shown["holder_lost"]["reason"] == "evicted"
    await lost.handle(key="h", target=entry.target, gpus=[entry.gpu], reason="again", revoke=revoke)
    assert harness.core.losses.notices[entry.gpu.uuid].reason == "evicted", "handled once"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert harness.core.losses.notices == {} and not lost.pending("h")
    assert harness.allocator.get(entry.gpu.uuid) is not None, "nothing revoked when cancelled"


async def test_an_operation_in_flight_is_waited_for(harness: Harness) -> None:
    entry = await _attached(harness)
    lost = _lost(harness, LostPolicy.REVOKE, grace=0)

    async def revoke(force: bool) -> TakeBack | None:
        return await harness.service.revoker.take_back(entry, force=force)

    async with harness.core.locks.operation(entry.target):
        task = asyncio.ensure_future(
            lost.handle(
                key="h", target=entry.target, gpus=[entry.gpu], reason="evicted", revoke=revoke
            )
        )
        while not lost.pending("h"):
            await asyncio.sleep(0)
        assert harness.allocator.get(entry.gpu.uuid) is not None
    await task
    assert harness.allocator.get(entry.gpu.uuid) is None


async def test_a_revoke_the_host_refuses_is_tried_again(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU stays usable while the revoke fails, so the sequence keeps trying."""
    monkeypatch.setattr(lost_module, "_FAILED_RETRY", 0.0)
    entry = await _attached(harness)
    lost = _lost(harness, LostPolicy.REVOKE, grace=0)
    tries = 0

    def refuse_once() -> Exception:
        nonlocal tries
        tries += 1
        harness.injector.revoke_error = None
        return InjectionFailed("cgroup busy", clean=True)

    harness.injector.revoke_error = refuse_once

    async def revoke(force: bool) -> TakeBack | None:
        return await harness.service.revoker.take_back(entry, force=force)

    await lost.handle(key="h", target=entry.target, gpus=[entry.gpu], reason="gone", revoke=revoke)

    assert tries == 1
    assert harness.allocator.get(entry.gpu.uuid) is None
