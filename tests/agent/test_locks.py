"""Per-target exclusion: operations refuse each other, wait for the reconciler, and the
reconciler never waits for anyone."""

from __future__ import annotations

import asyncio

import pytest

from jupyter_gpu_hotplug._structs import PidTarget
from jupyter_gpu_hotplug.agent.core.errors import Busy
from jupyter_gpu_hotplug.agent.core.locks import TargetLocks

KERNEL = PidTarget(100, 1)
OTHER = PidTarget(200, 1)


async def test_a_second_operation_on_a_target_is_busy() -> None:
    locks = TargetLocks()

    async with locks.operation(KERNEL):
        with pytest.raises(Busy) as caught:
            async with locks.operation(KERNEL):
                pass
        async with locks.operation(OTHER):  # other targets are not affected
            assert locks.is_held(OTHER)

    assert caught.value.retryable
    assert not locks.is_held(KERNEL)


async def test_an_operation_waits_for_the_reconciler() -> None:
    locks = TargetLocks()
    order: list[str] = []

    async def operate() -> None:
        async with locks.operation(KERNEL):
            order.append("operation")

    with locks.reconciling(KERNEL) as held:
        assert held
        task = asyncio.create_task(operate())
        await asyncio.sleep(0)  # the task runs until it waits for the lock
        assert not task.done()
        order.append("reconciled")
    await task

    assert order == ["reconciled", "operation"]
    assert not locks.is_held(KERNEL)


async def test_the_reconciler_skips_what_is_held() -> None:
    locks = TargetLocks()

    async with locks.operation(KERNEL):
        with locks.reconciling(KERNEL) as held:
            assert not held
    with locks.reconciling(KERNEL) as first, locks.reconciling(KERNEL) as second:
        assert (first, second) == (True, False)
    assert not locks.is_held(KERNEL)
