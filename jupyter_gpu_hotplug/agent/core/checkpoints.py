"""Named steps of attach and detach, and the test hook that can stop an operation at one.

Why it exists: crash safety is a claim about every point between two durable writes, and the
only convincing test kills the agent (``kill -9``) at each of them and restarts it. The service
announces each step here; normally nothing happens. With ``pause_at`` set (from the
``GPU_HOTPLUG_TEST_PAUSE_AT`` environment variable, read by the application), reaching that step
writes ``<marker_dir>/paused-at-<step>`` and the operation waits forever, so the test knows
exactly where the agent is when it kills it. Other requests keep being served meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Final

__all__ = ["ATTACH_STEPS", "DETACH_STEPS", "STEPS", "SUSPEND_STEPS", "Checkpoints", "marker_path"]

log = logging.getLogger(__name__)

ATTACH_STEPS: Final = ("after_reserve", "after_intent", "after_grant", "after_mark_granted")
"""Attach: ``reserving`` → the grant's intent recorded (``Allocator.intend_grant``) → host grant
→ ``granted``."""
DETACH_STEPS: Final = ("after_begin_release", "after_revoke")
"""Detach: ledger ``releasing`` → host revoke → ledger row removed."""
SUSPEND_STEPS: Final = ("after_suspend_intent", "after_checkpoint", "after_suspend_revoke")
"""Suspend (``suspend.py``): ``suspending`` recorded → processes locked and checkpointed → the
detach's revoke and release → ``suspended`` recorded."""
STEPS: Final = ATTACH_STEPS + DETACH_STEPS + SUSPEND_STEPS


def marker_path(marker_dir: Path, step: str) -> Path:
    """Where the marker of a pause at ``step`` is written."""
    return marker_dir / f"paused-at-{step}"


class Checkpoints:
    """Announced steps; pauses forever at ``pause_at`` (a test hook, ``None`` in production)."""

    def __init__(self, *, pause_at: str | None = None, marker_dir: Path | None = None) -> None:
        if pause_at is not None:
            if pause_at not in STEPS:
                raise ValueError(f"unknown step {pause_at!r}; the steps are {', '.join(STEPS)}")
            if marker_dir is None:
                raise ValueError("a pause needs a directory for its marker file")
        self._pause_at = pause_at
        self._marker_dir = marker_dir

    async def reach(self, step: str) -> None:
        """Announce ``step``; returns at once unless the test hook pauses here."""
        if step not in STEPS:
            raise ValueError(f"unknown step {step!r}")
        if step != self._pause_at or self._marker_dir is None:
            return
        marker = marker_path(self._marker_dir, step)
        marker.write_text(f"{os.getpid()}\n")
        log.warning("TEST HOOK: operation paused for good at step %s (%s)", step, marker)
        await asyncio.Event().wait()
