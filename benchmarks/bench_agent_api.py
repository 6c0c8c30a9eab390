"""Attach and detach latency through the agent's HTTP API, next to the engine's own cost.

Run as root on a host with cgroups:

    .venv/bin/python benchmarks/bench_agent_api.py [--runs 200]

Starts a local agent (``--simulate 8``) as a subprocess and one sandboxed process, then times
``POST /v1/attachments`` (one GPU) and ``DELETE /v1/attachments/<uuid>`` from a client on one
persistent connection: the whole path a terminal or notebook client sees (HTTP, auth, target
resolution, ledger writes, NVML inventory, the engine). For comparison it times the engine's
``grant`` and ``revoke`` of one GPU node on another sandbox in this process — back to back, and
paced (a pause of about one API call between engine calls, the rhythm the engine runs at inside
the agent: a call that finds the CPU idle and its caches cold costs more than one in a tight
loop) — and reads the agent's own operation histograms from ``/metrics``. Figures are printed,
never asserted.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _agent import percentile, start_agent, summary

from jupyter_gpu_hotplug._structs import NVIDIA_MAJOR
from jupyter_gpu_hotplug.linux.devnodes import DeviceNode
from jupyter_gpu_hotplug.linux.devrules import CharDevice
from jupyter_gpu_hotplug.linux.engine import HotplugEngine
from jupyter_gpu_hotplug.linux.sandbox.runtime import Sandbox, SandboxSpec

PARENT = "gpu-hotplug-sandboxes/bench-agent-api"


def sandbox() -> Sandbox:
    return Sandbox.start(
        SandboxSpec(("sleep", "100000"), cgroup_parent=PARENT, name_prefix="bench")
    )


def http_cycles(runs: int) -> tuple[list[float], list[float], dict[str, float], int]:
    with tempfile.TemporaryDirectory(prefix="bench-agent-api-") as tmp:
        agent = start_agent(Path(tmp) / "state", simulate=8)
        target = sandbox()
        try:
            client = agent.client()
            attach: list[float] = []
            detach: list[float] = []
            for _ in range(runs):
                start = time.perf_counter()
                status, body = client.request(
                    "POST", "/v1/attachments", {"count": 1, "target": {"pid": target.pid}}
                )
                attach.append(time.perf_counter() - start)
                assert status == 201, body
                uuid = body["attachments"][0]["uuid"]  # type: ignore[index]
                start = time.perf_counter()
                status, body = client.request("DELETE", f"/v1/attachments/{uuid}")
                detach.append(time.perf_counter() - start)
                assert status == 204, body
            client.close()
            scrape = urllib.request.Request(
                f"http://127.0.0.1:{agent.port}/metrics",
                headers={"Authorization": f"Bearer {agent.token}"},  # /metrics needs one
            )
            metrics = urllib.request.urlopen(scrape).read()
            server_side = _histogram_means(metrics.decode())
            rss = agent.rss_kib()
        finally:
            target.stop()
            agent.stop()
    return attach, detach, server_side, rss


def _histogram_means(text: str) -> dict[str, float]:
    means = {}
    for name in ("attach", "detach"):
        total = float(re.search(rf"gpu_hotplug_{name}_duration_seconds_sum (\S+)", text)[1])  # type: ignore[index]
        count = float(re.search(rf"gpu_hotplug_{name}_duration_seconds_count (\S+)", text)[1])  # type: ignore[index]
        means[name] = total / count
    return means


PACE = 0.005
"""Seconds between engine calls in the paced runs: about one API call."""


def engine_cycles(runs: int, *, pause: float = 0.0) -> tuple[list[float], list[float]]:
    engine = HotplugEngine()
    target = sandbox()
    node = [DeviceNode("nvidia0", CharDevice(NVIDIA_MAJOR, 0))]
    grant: list[float] = []
    revoke: list[float] = []
    try:
        for _ in range(runs):
            time.sleep(pause)
            start = time.perf_counter()
            engine.grant(target.pid, node)
            grant.append(time.perf_counter() - start)
            time.sleep(pause)
            start = time.perf_counter()
            engine.revoke(target.pid, node)
            revoke.append(time.perf_counter() - start)
    finally:
        target.stop()
    return grant, revoke


def ledger_commits(runs: int) -> list[float]:
    """One ledger transaction (the agent makes two per attach and two per detach)."""
    from jupyter_gpu_hotplug._structs import GpuUuid, PidTarget
    from jupyter_gpu_hotplug.agent.core.seams import ContainerKey, GpuRecord
    from jupyter_gpu_hotplug.agent.local.ledger import Ledger

    gpu = GpuRecord(GpuUuid("GPU-00000000-0000-4000-8000-000000000000"), 0, 0, "bench")
    samples: list[float] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp,
        Ledger.open(Path(tmp)) as ledger,
    ):
        for _ in range(runs):
            start = time.perf_counter()
            ledger.reserve(PidTarget(1234, 1), 1, container=ContainerKey("bench"), candidates=[gpu])
            samples.append(time.perf_counter() - start)
            ledger.release([gpu.uuid])
        ledger.close()
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    engine_grant, engine_revoke = engine_cycles(args.runs)
    paced_grant, paced_revoke = engine_cycles(args.runs, pause=PACE)
    attach, detach, server_side, rss = http_cycles(args.runs)
    commits = ledger_commits(args.runs)
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"one GPU, {args.runs} cycles, simulated GPUs, load {load}")
    pace = f"paced, {PACE * 1000:.0f} ms apart"
    for label, samples in (
        ("engine grant (in process)", engine_grant),
        ("engine revoke (in process)", engine_revoke),
        (f"engine grant ({pace})", paced_grant),
        (f"engine revoke ({pace})", paced_revoke),
        ("ledger commit (WAL)", commits),
        ("HTTP POST /v1/attachments", attach),
        ("HTTP DELETE /v1/attachments/UUID", detach),
    ):
        print(f"  {label:<44} {summary(samples)}")
    lines = {
        "agent's own view (metrics mean)": (server_side["attach"], server_side["detach"]),
        "API overhead over the engine, median": (
            percentile(attach, 0.5) - percentile(engine_grant, 0.5),
            percentile(detach, 0.5) - percentile(engine_revoke, 0.5),
        ),
        "API overhead over the paced engine, median": (
            percentile(attach, 0.5) - percentile(paced_grant, 0.5),
            percentile(detach, 0.5) - percentile(paced_revoke, 0.5),
        ),
    }
    for label, (on_attach, on_detach) in lines.items():
        print(f"  {label:<44} attach {on_attach * 1000:.2f} ms, detach {on_detach * 1000:.2f} ms")
    print(f"  {'agent RSS after the runs':<44} {rss / 1024:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
