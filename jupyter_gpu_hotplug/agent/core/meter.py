"""Attaches and detaches as the operator sees them: how many run now, how each ended, how long
it took — and, at shutdown, when the last one has ended.

Why it exists: every attach and detach is counted the same way (``gpu_hotplug_attach_total``
by result, its duration, ``gpu_hotplug_operations_in_flight``), and the agent's drain at
shutdown (``runtime.py``) waits on the same in-flight count. One meter keeps the count and the
metrics from ever disagreeing, and keeps the bookkeeping out of the operations themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from .errors import AgentError
from .metrics import AgentMetrics

__all__ = ["Measure", "OperationMeter"]


@dataclass
class Measure:
    """What an operation reports about itself for its metrics."""

    gpus: int = 1
    """How many GPUs it concerned (detach counts per GPU)."""


class OperationMeter:
    """The in-flight count and the per-result metrics of one agent's attaches and detaches."""

    def __init__(self) -> None:
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no attach or detach is running (new ones may start later)."""
        await self._idle.wait()

    @contextlib.contextmanager
    def measured(
        self, metrics: AgentMetrics, kind: Literal["attach", "detach"]
    ) -> Iterator[Measure]:
        """One attach or detach: in flight while it runs, then counted by result (``success``
        or the API error code; anything else is an ``internal_error``) and timed."""
        measure = Measure()
        started = time.monotonic()
        result = "internal_error"
        counter, histogram = (
            (metrics.attach_total, metrics.attach_duration)
            if kind == "attach"
            else (metrics.detach_total, metrics.detach_duration)
        )
        with self._in_flight_in(metrics):
            try:
                yield measure
                result = "success"
            except AgentError as e:
                result = e.code
                raise
            finally:
                counter.labels(result=result).inc(measure.gpus)
                histogram.observe(time.monotonic() - started)

    @contextlib.contextmanager
    def _in_flight_in(self, metrics: AgentMetrics) -> Iterator[None]:
        """Count an operation as in flight (the metric, and ``wait_idle`` for shutdown)."""
        self._in_flight += 1
        self._idle.clear()
        metrics.in_flight.inc()
        try:
            yield
        finally:
            metrics.in_flight.dec()
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()
