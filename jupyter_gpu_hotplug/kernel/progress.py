"""How a long ``%gpu`` operation shows that it is still waiting: one progress line, kept up to
date from the kernel's thread while the blocking request runs in a worker.

Boundary: display only (IPython's display for notebooks, a stream for terminals) and one worker
thread; it knows nothing of the agent beyond the ``queued()`` call ``QueuePlace`` makes.

In a notebook the line is a display updated in place by its id; on a terminal it is rewritten
with ``\\r``; when output is not a terminal it is printed once. Output only ever comes from the
kernel's thread: ipykernel routes output by thread, and a worker's prints would land in
whichever cell runs when they happen.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import sys
import time
import uuid
from collections.abc import Callable
from typing import IO, Final, Protocol, TypeVar

from ..client import AgentClient, AgentClientError
from .errors import GpuCommandError

__all__ = [
    "PROGRESS_AFTER",
    "PROGRESS_TICK",
    "DisplayProgress",
    "Progress",
    "QueuePlace",
    "TerminalProgress",
    "display_raw",
    "wait_with_progress",
]

PROGRESS_AFTER: Final = 0.5
"""Seconds an operation may take before a progress line appears (quick ones show none)."""
PROGRESS_TICK: Final = 0.25
"""Seconds between two updates of the progress line."""

_SPINNER: Final = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
_T = TypeVar("_T")


class Progress(Protocol):
    """Where a long operation reports that it is still waiting."""

    def update(self, label: str, elapsed: float) -> None:
        """Still waiting after ``elapsed`` seconds (called every ``PROGRESS_TICK``)."""

    def finish(self, summary: str) -> None:
        """The wait is over; ``summary`` replaces the progress line."""


class DisplayProgress:
    """A progress line in a notebook: one display, updated in place by its id."""

    def __init__(self) -> None:
        self._display_id = f"gpu-hotplug-progress-{uuid.uuid4().hex}"
        self._shown = False
        self._frames = itertools.cycle(_SPINNER)

    def update(self, label: str, elapsed: float) -> None:
        self._show(f"{next(self._frames)} {label}… {elapsed:.0f} s")

    def finish(self, summary: str) -> None:
        self._show(summary)

    def _show(self, text: str) -> None:
        display_raw({"text/plain": text}, display_id=self._display_id, update=self._shown)
        self._shown = True


def display_raw(
    data: dict[str, str], *, display_id: str | None = None, update: bool = False
) -> None:
    """Publish raw mime ``data`` (IPython's ``display`` is untyped; this is its one caller)."""
    from IPython.display import display

    display(data, raw=True, display_id=display_id, update=update)  # type: ignore[no-untyped-call]


class TerminalProgress:
    """A progress line on a terminal (rewritten with ``\\r``), or one line when not a tty."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self._stream = stream
        self._frames = itertools.cycle(_SPINNER)
        self._width = 0
        self._announced = False

    @property
    def stream(self) -> IO[str]:
        # Looked up late: IPython and pytest replace sys.stdout after this object is made.
        return self._stream or sys.stdout

    def update(self, label: str, elapsed: float) -> None:
        stream = self.stream
        if stream.isatty():
            self._rewrite(f"{next(self._frames)} {label}… {elapsed:.0f} s")
        elif not self._announced:
            print(f"{label}…", file=stream, flush=True)
        self._announced = True

    def finish(self, summary: str) -> None:
        if self.stream.isatty() and self._announced:
            self._rewrite(summary)
            print(file=self.stream, flush=True)

    def _rewrite(self, text: str) -> None:
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width = len(text)


def wait_with_progress(
    call: Callable[[], _T],
    *,
    label: str,
    new_progress: Callable[[], Progress],
    after: float = PROGRESS_AFTER,
    tick: float = PROGRESS_TICK,
    detail: Callable[[], str] = lambda: "",
) -> _T:
    """``call()`` in a worker thread while this thread keeps a progress line up to date;
    ``detail()`` adds to the line what is known of the wait (its place in the queue).

    The worker only makes the blocking request; everything shown is shown from here.
    """
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpu-hotplug-magic")
    started = time.monotonic()
    progress: Progress | None = None
    outcome = "failed"
    try:
        future = pool.submit(call)
        timeout = after
        while True:
            try:
                result = future.result(timeout=timeout)
            except concurrent.futures.TimeoutError:
                progress = progress or new_progress()
                progress.update(label + detail(), time.monotonic() - started)
                timeout = tick
                continue
            outcome = "done"
            return result
    except KeyboardInterrupt as interrupt:
        outcome = "interrupted"
        raise GpuCommandError(
            "Interrupted: stopped waiting. The agent may still finish; run '%gpu status' "
            "to see what this kernel has."
        ) from interrupt
    finally:
        # Never wait for the worker here: after an interrupt it may still be blocked.
        pool.shutdown(wait=False)
        if progress is not None:
            progress.finish(f"{label}: {outcome} after {time.monotonic() - started:.1f} s")


class QueuePlace:
    """ ", waiting, position 2 of 3" while this kernel's attach waits in the agent's queue;
    asked of the agent at most every ``interval`` seconds, and empty when it does not say."""

    def __init__(self, client: AgentClient, *, interval: float = 1.0) -> None:
        self._client = client
        self._interval = interval
        self._asked = float("-inf")
        self._text = ""

    def __call__(self) -> str:
        now = time.monotonic()
        if now - self._asked >= self._interval:
            self._asked = now
            try:
                waiting = self._client.queued()
            except AgentClientError:
                waiting = ()  # an older agent, or none: the line shows the time only
            self._text = (
                f", waiting, position {waiting[0].position} of {waiting[0].length}"
                if waiting
                else ""
            )
        return self._text
