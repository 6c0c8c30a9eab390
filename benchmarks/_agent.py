"""Shared by the agent benchmarks: start a local agent subprocess, talk to it, read its RSS.

Not a benchmark itself. The agent runs as ``python -m jupyter_gpu_hotplug.agent.app`` with
simulated GPUs over a temporary state dir, listening on ``127.0.0.1:0``; its port is read back
from its log. Requests use one persistent HTTP/1.1 connection per client (as a real client
would), so the figures measure the agent, not TCP handshakes.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

_SERVING = re.compile(r"serving the agent API on 127\.0\.0\.1:(\d+)")
# The Kubernetes-mode agent's log line for each attach's holder pods (allocator.py).
_HOLDER_WAIT = re.compile(r"holder pod\(s\) .*: running after ([0-9.]+) ms")


def remove_parent_cgroups(parent: str) -> None:
    """Remove a benchmark's (now empty) parent cgroup of its sandboxes from every hierarchy."""
    from jupyter_gpu_hotplug.linux import cgroups

    found = cgroups.discover()
    for mount in (found.devices_v1, found.unified):
        if mount is not None:
            with contextlib.suppress(OSError):  # already gone, or another run's sandboxes
                (mount.mount_point / parent).rmdir()


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(samples: list[float]) -> str:
    """``median X ms  p99 Y ms  (n=N)`` for samples in seconds."""
    if not samples:
        return "no samples"
    return (
        f"median {statistics.median(samples) * 1000:7.2f} ms   "
        f"p99 {percentile(samples, 0.99) * 1000:7.2f} ms   (n={len(samples)})"
    )


@dataclass
class RunningAgent:
    process: subprocess.Popen[bytes]
    port: int
    token: str
    log_path: Path

    def rss_kib(self) -> int:
        """Resident set size of the agent process, from ``/proc/<pid>/status``."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS line")

    def cpu_seconds(self) -> float:
        """User plus system CPU time the agent has used (``/proc/<pid>/stat``)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def client(self) -> Client:
        return Client(self.port, self.token)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


def start_agent(
    state_dir: Path,
    *,
    simulate: int,
    extra: list[str] | None = None,
    python: str = sys.executable,
) -> RunningAgent:
    """An agent subprocess; ``python`` picks the interpreter, and with its environment the
    checkout that runs (``bench_agent_ab.py`` compares two)."""
    log_path = state_dir.parent / "agent.log"
    argv = [
        python,
        "-m",
        "jupyter_gpu_hotplug.agent.app",
        "--backend=local",
        f"--simulate={simulate}",
        f"--state-dir={state_dir}",
        "--listen=127.0.0.1:0",
        "--reconcile-interval=0",
        *(extra or []),
    ]
    with log_path.open("wb") as log:
        # Not from the current directory: ``-m`` would import a checkout found there instead
        # of the one ``python``'s environment installs.
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=state_dir.parent
        )
    deadline = time.monotonic() + 60
    while True:
        text = log_path.read_text(errors="replace")
        if "agent ready" in text:
            break
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the agent did not start:\n{text}")
        time.sleep(0.05)
    match = _SERVING.search(text)
    if match is None:
        raise RuntimeError(f"no TCP address in the agent's log:\n{text}")
    token = (state_dir / "token").read_text().strip()
    return RunningAgent(process, int(match[1]), token, log_path)


class Client:
    """One persistent connection with the agent token."""

    def __init__(self, port: int, token: str) -> None:
        self._port = port
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def request(self, method: str, path: str, body: object = None) -> tuple[int, object]:
        payload = None if body is None else json.dumps(body).encode()
        try:
            self._connection.request(method, path, body=payload, headers=self._headers)
            response = self._connection.getresponse()
        except (http.client.HTTPException, ConnectionError):
            # The server may close an idle keep-alive connection: reconnect once.
            self._connection.close()
            self._connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=120)
            self._connection.request(method, path, body=payload, headers=self._headers)
            response = self._connection.getresponse()
        data = response.read()
        return response.status, (json.loads(data) if data else None)

    def close(self) -> None:
        self._connection.close()


class _Poster(Protocol):
    """What the crowd needs of a client: tests.agent.api_harness.ApiClient."""

    def post(self, path: str, body: object = None) -> Any: ...


class _Attacher(_Poster, Protocol):
    """What the attach/detach loop needs of a client: tests.agent.api_harness.ApiClient."""

    def delete(self, path: str) -> Any: ...


def time_attach_detach(api: _Attacher, runs: int) -> tuple[list[float], list[float]]:
    """``runs`` times ``POST /v1/attachments {"count": 1}`` then ``DELETE`` of the GPU it
    gave, each timed over the whole HTTP path: (attach seconds, detach seconds)."""
    attach: list[float] = []
    detach: list[float] = []
    for _ in range(runs):
        start = time.perf_counter()
        created = api.post("/v1/attachments", {"count": 1})
        attach.append(time.perf_counter() - start)
        assert created.status == 201, created.body
        uuid = created.json()["attachments"][0]["uuid"]
        start = time.perf_counter()
        assert api.delete(f"/v1/attachments/{uuid}").status == 204
        detach.append(time.perf_counter() - start)
    return attach, detach


def holder_waits(agent_log: str, runs: int) -> list[float]:
    """Seconds from creating its holder to seeing it Running, as a Kubernetes-mode agent
    logged them, for its last ``runs`` attaches: subtracted from the same attaches'
    latencies, they leave the agent's own work without the cluster's pod start."""
    return [float(m) / 1000 for m in _HOLDER_WAIT.findall(agent_log)][-runs:]


def attach_at_once(clients: Mapping[str, _Poster]) -> dict[str, tuple[int, list[str], float]]:
    """Every client POSTs ``{"count": 1}`` at the same moment (a barrier); per client its
    answer's status, the UUIDs it was given, and its latency in seconds."""
    barrier = threading.Barrier(len(clients))
    results: dict[str, tuple[int, list[str], float]] = {}

    def attach(name: str) -> None:
        barrier.wait()
        start = time.perf_counter()
        response = clients[name].post("/v1/attachments", {"count": 1})
        elapsed = time.perf_counter() - start
        ok = response.status == 201
        uuids = [a["uuid"] for a in response.json()["attachments"]] if ok else []
        results[name] = (response.status, uuids, elapsed)

    threads = [threading.Thread(target=attach, args=(name,)) for name in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@dataclass
class Crowd:
    """What rounds of ``attach_at_once`` gave: every answer's latency, the count of each
    status, and how often a GPU was handed out twice (in the answers or the kubelet's view)."""

    latencies: list[float]
    statuses: dict[int, int]
    doubles: int

    def answers(self) -> str:
        """One line: how many answers had each status, and the GPUs handed out twice."""
        statuses = dict(sorted(self.statuses.items()))
        return f"answers: {statuses}   GPUs handed out twice: {self.doubles}"


def crowd_rounds(
    clients: Mapping[str, _Attacher], rounds: int, assigned: Callable[[], list[str]]
) -> Crowd:
    """``rounds`` times: every client attaches one GPU at once, GPUs handed out twice are
    counted in the answers and in ``assigned()`` (the device IDs PodResources lists), and each
    client detaches what it got."""
    crowd = Crowd([], {}, 0)
    for _ in range(rounds):
        results = attach_at_once(clients)
        granted = [uuid for _, uuids, _ in results.values() for uuid in uuids]
        held = assigned()
        crowd.doubles += (len(granted) - len(set(granted))) + (len(held) - len(set(held)))
        for status, _, elapsed in results.values():
            crowd.statuses[status] = crowd.statuses.get(status, 0) + 1
            crowd.latencies.append(elapsed)
        for name, (_, uuids, _) in results.items():
            for uuid in uuids:
                assert clients[name].delete(f"/v1/attachments/{uuid}").status == 204
    return crowd
