"""The sandbox event registry: listeners of every kind get every event, failures stay contained."""

from __future__ import annotations

import logging

import pytest

from jupyter_gpu_hotplug.sandboxes.events import SandboxEvent, SandboxEventKind, SandboxEvents


async def test_events_reach_sync_and_async_listeners_and_survive_a_failing_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events = SandboxEvents()
    seen: list[tuple[str, SandboxEvent]] = []

    def broken(event: SandboxEvent) -> None:
        raise RuntimeError("listener bug")

    async def async_listener(event: SandboxEvent) -> None:
        seen.append(("async", event))

    events.subscribe(broken)
    unsubscribe = events.subscribe(lambda event: seen.append(("sync", event)))
    events.subscribe(async_listener)
    event = SandboxEvent(SandboxEventKind.STARTED, "k", 42, "kernel.1-2.ab", restart=False)

    with caplog.at_level(logging.ERROR):
        await events.emit(event)
    unsubscribe()
    unsubscribe()  # Idempotent.
    await events.emit(event)

    assert seen == [("sync", event), ("async", event), ("async", event)]
    assert "listener bug" in caplog.text
