"""Cost of the live GPU stream: server CPU, messages per second and agent requests per second
with 4 open notebooks and 8 simulated GPUs whose readings change every second.

Run as root (the demo sandboxes its kernels; about 3 x --duration s plus a demo start):

    .venv/bin/python benchmarks/bench_stream.py [--duration 30]

It starts ``jupyter gpu-hotplug demo --simulate=8`` (the real JupyterLab with the server
extension, sandboxed kernels and a local-mode agent), starts 4 kernels through the REST API
(what 4 open notebooks are to the server) and attaches 2 GPUs to each, so all 8 are in use.
Meanwhile this process rewrites the simulated node every second with new utilisation, memory
and temperature on every GPU. It then plays the browsers: each open notebook is one
server-sent-events stream of its kernel (``GET gpu-hotplug/api/stream?kernel_id=K``, as the
toolbar item, the panel and the status bar share one per kernel), read over plain sockets.

Phases of ``--duration`` seconds each:

- ``no stream``: the 4 kernels with their GPUs, nothing watching (the server's own baseline);
- ``4 notebooks``: one stream per kernel;
- ``4 notebooks x 5 tabs``: 20 streams (the same notebooks open in 5 browser tabs).

Printed per phase: the JupyterLab server process's CPU (percent of one core, from
``/proc/<pid>/stat``), the events per second the clients received and their bytes per second,
and the agent's API requests per second (its ``/metrics`` counter, scrapes excluded). Figures
are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from jupyter_gpu_hotplug.demo.layout import DemoLayout
from jupyter_gpu_hotplug.nvml.sim import read_config, write_config

GPUS = 8
NOTEBOOKS = 4
TABS = 5
_URL = re.compile(r"(?P<base>http://\S+?:\d+)/lab/tree/\S+\?token=(?P<token>[0-9a-f]+)")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")


class Demo:
    def __init__(self, root: Path) -> None:
        self.layout = DemoLayout(root, root.parent / "notebooks")
        self.output = root.parent / "demo.out"
        argv = [
            str(Path(sys.executable).with_name("jupyter")),
            "gpu-hotplug",
            "demo",
            f"--simulate={GPUS}",
            "--no-browser",
            f"--port={free_port()}",
            f"--state-dir={root}",
            f"--notebook-dir={self.layout.notebooks}",
        ]
        with self.output.open("wb") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while (match := _URL.search(self.output.read_text())) is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the demo did not start:\n{self.output.read_text()}")
            time.sleep(0.2)
        self.base, self.token = match["base"], match["token"]
        [self.lab_pid] = [p for p in children(self.process.pid) if "jupyterlab" in cmdline(p)]

    def request(self, method: str, path: str, body: object = None) -> object:
        request = urllib.request.Request(
            f"{self.base}/{path}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            text = answer.read()
        return json.loads(text) if text else None

    def agent_requests(self) -> float:
        """The agent's API requests so far (over its unix socket), scrapes excluded."""
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(str(self.layout.agent_socket))
            conn.sendall(b"GET /metrics HTTP/1.0\r\nHost: agent\r\n\r\n")
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
        total = 0.0
        for line in data.decode().splitlines():
            if line.startswith("gpu_hotplug_http_requests_total{") and "/metrics" not in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(180)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def move_readings(config_path: Path, stop: asyncio.Event) -> None:
    """Every second, new readings on every simulated GPU."""
    rng = random.Random(7)
    while not stop.is_set():
        config = await asyncio.to_thread(read_config, config_path)
        gpus = tuple(
            dataclasses.replace(
                gpu,
                utilization_gpu=rng.randint(0, 100),
                memory_used=gpu.memory_total * rng.randint(5, 95) // 100,
                temperature=rng.randint(30, 80),
            )
            for gpu in config.gpus
        )
        await asyncio.to_thread(write_config, config_path, dataclasses.replace(config, gpus=gpus))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


@dataclasses.dataclass
class Counts:
    events: int = 0
    bytes: int = 0


async def read_stream(demo: Demo, kernel_id: str, counts: Counts, stop: asyncio.Event) -> None:
    host, port = demo.base.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"GET /gpu-hotplug/api/stream?kernel_id={kernel_id} HTTP/1.0\r\nHost: {host}\r\n"
        f"Authorization: token {demo.token}\r\nAccept: text/event-stream\r\n\r\n".encode()
    )
    await writer.drain()
    try:
        while not stop.is_set():
            try:
                line = await asyncio.wait_for(reader.readline(), 0.5)
            except TimeoutError:
                continue
            if not line:
                break
            counts.bytes += len(line)
            if line.startswith(b"event: "):
                counts.events += 1
    finally:
        writer.close()


async def phase(demo: Demo, name: str, kernels: list[str], tabs: int, duration: float) -> None:
    counts = Counts()
    stop = asyncio.Event()
    readers = [
        asyncio.create_task(read_stream(demo, kernel, counts, stop))
        for kernel in kernels
        for _ in range(tabs)
    ]
    await asyncio.sleep(3)  # streams open, first readings in
    counts.events = counts.bytes = 0
    cpu, requests, started = cpu_seconds(demo.lab_pid), demo.agent_requests(), time.monotonic()
    await asyncio.sleep(duration)
    elapsed = time.monotonic() - started
    cpu = cpu_seconds(demo.lab_pid) - cpu
    requests = demo.agent_requests() - requests
    events, sent = counts.events, counts.bytes
    stop.set()
    await asyncio.gather(*readers)
    print(
        f"{name:<24} streams {len(readers):3d}   server CPU {100 * cpu / elapsed:5.1f} % of a core"
        f"   events {events / elapsed:6.1f}/s   {sent / elapsed / 1024:6.1f} KiB/s"
        f"   agent requests {requests / elapsed:5.1f}/s",
        flush=True,
    )


async def run(demo: Demo, duration: float) -> None:
    kernels = []
    for _ in range(NOTEBOOKS):
        kernel = demo.request("POST", "api/kernels", {"name": "python3"})
        assert isinstance(kernel, dict)
        kernels.append(str(kernel["id"]))
        demo.request("POST", "gpu-hotplug/api/attach", {"count": 2, "kernel_id": kernel["id"]})
    stop = asyncio.Event()
    mover = asyncio.create_task(move_readings(demo.layout.simulation_config, stop))
    try:
        await phase(demo, "no stream", kernels, 0, duration)
        await phase(demo, f"{NOTEBOOKS} notebooks", kernels, 1, duration)
        await phase(demo, f"{NOTEBOOKS} notebooks x {TABS} tabs", kernels, TABS, duration)
    finally:
        stop.set()
        await mover


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--duration", type=float, default=30.0)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gh-bench-", dir="/tmp") as tmp:
        demo = Demo(Path(tmp) / "demo")
        try:
            print(
                f"{NOTEBOOKS} kernels x 2 of {GPUS} simulated GPUs, readings moving every second;"
                f" {options.duration:g} s per phase",
                flush=True,
            )
            asyncio.run(run(demo, options.duration))
        finally:
            demo.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
