"""Kernel CPU cost of the live GPU monitor widget: 8 simulated GPUs, refreshed at 1 Hz.

Run (no root, no GPU; builds the fake NVML into a temporary cache; about 4 x --duration s):

    .venv/bin/python benchmarks/bench_widget_overhead.py [--duration 30] [--gpus 8]

A real ipykernel is started with the fake NVML on its library path and a simulated node of
``--gpus`` GPUs. This process plays the frontend: it drains the kernel's IOPub messages (the
widget updates) the whole time. The kernel's CPU time is read *inside* the kernel with
``resource.getrusage(RUSAGE_SELF)`` (all its threads: shell loop, IOPub, heartbeat, control)
over each phase of ``--duration`` seconds of wall time; nothing is executed meanwhile.

Phases:

- ``idle kernel``: no widget; ipykernel's own background cost.
- ``widget, readings still``: ``%gpu monitor`` showing, values unchanged (each tick takes a
  snapshot; traitlets sends nothing when nothing changed).
- ``widget, readings moving``: this process rewrites the simulated node every second with new
  utilisation, memory, temperature, power and processes on every GPU, so each tick sends
  updates for every row (the worst case of 1 Hz).
- ``widget closed``: after ``close()``; should be back at the idle figure.

Also printed: the time one refresh blocks the kernel's event loop (snapshot plus model updates,
median and p99 over 300 synchronous refreshes with moving readings). Figures are printed, never
asserted. Target: widget overhead well under 1 % of one core.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager, start_new_kernel

from jupyter_gpu_hotplug.nvml.sim import (
    CONFIG_ENV,
    FakeNvmlConfig,
    SimulatedProcess,
    default_gpus,
    ensure_fake_nvml,
    write_config,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120.0

_SETUP = """
import resource as _resource, time as _time, json as _json
def _cpu():
    usage = _resource.getrusage(_resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
def _mark():
    global _t0
    _t0 = (_cpu(), _time.monotonic())
def _report():
    cpu, wall = _cpu() - _t0[0], _time.monotonic() - _t0[1]
    print(_json.dumps({"cpu": cpu, "wall": wall}))
"""

_REFRESH_COST = """
import statistics as _statistics
_samples = []
for _i in range(300):
    if _i % 10 == 0:
        _move()
    _start = _time.perf_counter()
    _w.refresh()
    _samples.append((_time.perf_counter() - _start) * 1e6)
_samples.sort()
print(_json.dumps({"median": _statistics.median(_samples),
                   "p99": _samples[int(0.99 * (len(_samples) - 1))]}))
"""


def moved(config: FakeNvmlConfig, rng: random.Random) -> FakeNvmlConfig:
    """Every GPU with new readings (as a busy node would report them)."""
    return dataclasses.replace(
        config,
        gpus=tuple(
            dataclasses.replace(
                gpu,
                utilization_gpu=rng.randint(0, 100),
                utilization_memory=rng.randint(0, 100),
                memory_used=rng.randint(0, gpu.memory_total),
                temperature=rng.randint(30, 85),
                power_usage=rng.randint(60_000, gpu.power_limit or 700_000),
                processes=(SimulatedProcess(4_000_000 + index, rng.randint(0, 2**34)),),
            )
            for index, gpu in enumerate(config.gpus)
        ),
    )


class Session:
    """The kernel, and this process acting as its frontend."""

    def __init__(self, manager: KernelManager, client: BlockingKernelClient) -> None:
        self.manager = manager
        self.client = client

    def run(self, code: str) -> str:
        out: list[str] = []

        def hook(message: dict[str, Any]) -> None:
            if message["msg_type"] == "stream" and message["content"]["name"] == "stdout":
                out.append(message["content"]["text"])
            elif message["msg_type"] == "error":
                raise RuntimeError("\n".join(message["content"]["traceback"]))

        reply = self.client.execute_interactive(code, timeout=TIMEOUT_S, output_hook=hook)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"kernel error: {reply['content']}")
        return "".join(out)

    def idle(self, seconds: float, *, each_second: Callable[[], None] | None = None) -> int:
        """Drain IOPub for ``seconds``; the number of comm messages (widget updates) seen."""
        deadline = time.monotonic() + seconds
        next_tick = time.monotonic() + 1.0
        comm_messages = 0
        while (now := time.monotonic()) < deadline:
            if each_second is not None and now >= next_tick:
                each_second()
                next_tick += 1.0
            try:
                message = self.client.get_iopub_msg(timeout=min(0.2, deadline - now))
            except queue.Empty:
                continue
            comm_messages += message["msg_type"] == "comm_msg"
        return comm_messages

    def phase(
        self, label: str, seconds: float, *, each_second: Callable[[], None] | None = None
    ) -> float:
        self.run("_mark()")
        comm_messages = self.idle(seconds, each_second=each_second)
        figures = json.loads(self.run("_report()"))
        percent = 100.0 * float(figures["cpu"]) / float(figures["wall"])
        print(
            f"  {label:<28} {percent:6.3f} % of one core   "
            f"({figures['cpu'] * 1000:7.1f} ms CPU in {figures['wall']:.1f} s; "
            f"{comm_messages / figures['wall']:5.1f} widget messages/s)"
        )
        return percent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per phase (>= 30)")
    parser.add_argument("--gpus", type=int, default=8, help="simulated GPUs (default 8)")
    args = parser.parse_args()
    duration = max(args.duration, 30.0)

    with tempfile.TemporaryDirectory(prefix="bench-widget-") as scratch:
        root = Path(scratch)
        library = ensure_fake_nvml(root / "cache")
        config_path = root / "fake-nvml.conf"
        config = FakeNvmlConfig(gpus=default_gpus(args.gpus))
        write_config(config_path, config)
        rng = random.Random(42)

        def move() -> None:
            write_config(config_path, moved(config, rng))

        pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env = {
            **os.environ,
            "LD_LIBRARY_PATH": os.pathsep.join(
                filter(None, [str(library), os.environ.get("LD_LIBRARY_PATH")])
            ),
            CONFIG_ENV: str(config_path),
            "PYTHONPATH": pythonpath,
            "JUPYTER_RUNTIME_DIR": str(root / "runtime"),
            "IPYTHONDIR": str(root / "ipython"),
            # No agent here: the monitor only reads NVML, its buttons stay unused.
            "GPU_HOTPLUG_AGENT_URL": f"unix:{root / 'no-agent.sock'}",
        }
        manager, client = start_new_kernel(kernel_name="python3", env=env)
        session = Session(manager, client)
        try:
            session.run(_SETUP)
            session.run("%load_ext jupyter_gpu_hotplug")
            # A kernel's first seconds include imports and warm-up; let them pass.
            session.idle(3.0)
            print(
                f"GPU monitor widget in a real ipykernel, {args.gpus} simulated GPUs, "
                f"1 Hz refresh, {duration:.0f} s per phase ({sys.platform}, "
                f"{os.cpu_count()} CPUs)"
            )
            idle = session.phase("idle kernel", duration)
            session.run(
                "%gpu monitor --interval 1\n"
                "import ipywidgets as _ipywidgets\n"
                "_w = next(w for w in _ipywidgets.widgets.widget._instances.values() "
                "if type(w).__name__ == 'GpuMonitorWidget')\n"
                f"assert len(_w.rows) == {args.gpus}, _w.text()"
            )
            still = session.phase("widget, readings still", duration)
            moving = session.phase("widget, readings moving", duration, each_second=move)
            session.run(
                "import dataclasses as _dc, random as _random\n"
                "from pathlib import Path as _Path\n"
                "from jupyter_gpu_hotplug.nvml.sim import read_config as _read, "
                "write_config as _write\n"
                f"_path = _Path({str(config_path)!r})\n"
                "_rng = _random.Random(7)\n"
                "def _move():\n"
                "    c = _read(_path)\n"
                "    _write(_path, _dc.replace(c, gpus=tuple(_dc.replace(g, "
                "utilization_gpu=_rng.randint(0, 100), temperature=_rng.randint(30, 85)) "
                "for g in c.gpus)))\n"
            )
            cost = json.loads(session.run(_REFRESH_COST))
            session.run("_w.close(); await _w.wait_closed()")
            closed = session.phase("widget closed", duration)
            print(
                f"  overhead of the live widget: {still - idle:+.3f} % (still), "
                f"{moving - idle:+.3f} % (moving) of one core; after close {closed - idle:+.3f} %"
            )
            print(
                f"  one refresh blocks the kernel loop for: median {cost['median']:.0f} µs, "
                f"p99 {cost['p99']:.0f} µs"
            )
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=True)


if __name__ == "__main__":
    main()
