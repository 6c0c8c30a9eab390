"""Where the agent's blocking calls run, so that the event loop never waits on them.

Why two places: the ledger is one SQLite connection whose every write goes to disk (and now
and then waits for an ``fsync`` at a WAL checkpoint), and it serialises its callers anyway;
given threads of a shared pool, queued ledger writes would occupy all of them and starve the
host and NVML calls of unrelated requests (a ``GET /v1/gpus`` would wait behind other
targets' commits). So the ledger gets one thread of its own, where its calls queue in order,
and the host (``/proc``, cgroups, device nodes, the engine) and NVML share a pool.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["Workers"]

_T = TypeVar("_T")


class Workers:
    """The ledger's thread and the host's pool; ``shutdown`` waits for calls under way."""

    def __init__(self, *, host_threads: int = 8) -> None:
        self._host = ThreadPoolExecutor(host_threads, thread_name_prefix="gpu-hotplug-host")
        self._ledger = ThreadPoolExecutor(1, thread_name_prefix="gpu-hotplug-ledger")

    async def host(self, function: Callable[..., _T], /, *args: object, **kwargs: object) -> _T:
        """Run ``function`` (``/proc``, cgroups, the engine, NVML) in the host pool."""
        call = functools.partial(function, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._host, call)

    async def ledger(self, function: Callable[..., _T], /, *args: object, **kwargs: object) -> _T:
        """Run a ledger call in the ledger's thread, after those queued before it."""
        call = functools.partial(function, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._ledger, call)

    def shutdown(self) -> None:
        self._host.shutdown(wait=True, cancel_futures=True)
        self._ledger.shutdown(wait=True, cancel_futures=True)
