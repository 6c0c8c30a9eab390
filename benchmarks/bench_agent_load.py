"""The agent under load: many clients cycling attach/detach over few GPUs.

Run as root on a host with cgroups:

    .venv/bin/python benchmarks/bench_agent_load.py [--clients 50] [--gpus 8] [--seconds 30]

Starts a local agent with ``--simulate GPUS`` and one sandboxed process per client. Each client
(a thread with one persistent connection) loops: ``POST /v1/attachments`` for one GPU on its
sandbox; on 201 ``DELETE`` it again at once; on 409 ``insufficient_gpus`` try again. Meanwhile
one more client polls ``GET /v1/gpus``. Printed: completed attach/detach cycles per second,
latency of successful attaches and detaches and of refusals, ``GET /v1/gpus`` latency under
load, and the agent's RSS at idle and its peak under load. The clients run in this process
(Python threads), so on a small machine they compete with the agent for the CPU: the figures
are a lower bound of what the agent alone could do. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from _agent import RunningAgent, start_agent, summary

from jupyter_gpu_hotplug.linux.sandbox.runtime import Sandbox, SandboxSpec

PARENT = "gpu-hotplug-sandboxes/bench-agent-load"


@dataclass
class Tally:
    attach: list[float] = field(default_factory=list)
    detach: list[float] = field(default_factory=list)
    refused: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def cycle(agent: RunningAgent, pid: int, stop: threading.Event, tally: Tally) -> None:
    client = agent.client()
    try:
        while not stop.is_set():
            start = time.perf_counter()
            status, body = client.request(
                "POST", "/v1/attachments", {"count": 1, "target": {"pid": pid}}
            )
            elapsed = time.perf_counter() - start
            if status == 409:
                tally.refused.append(elapsed)
                continue
            if status != 201:
                tally.errors.append(f"attach {status}: {body}")
                continue
            tally.attach.append(elapsed)
            uuid = body["attachments"][0]["uuid"]  # type: ignore[index]
            start = time.perf_counter()
            status, body = client.request("DELETE", f"/v1/attachments/{uuid}")
            if status == 204:
                tally.detach.append(time.perf_counter() - start)
            else:
                tally.errors.append(f"detach {status}: {body}")
    finally:
        client.close()


def poll_gpus(agent: RunningAgent, stop: threading.Event, samples: list[float]) -> None:
    client = agent.client()
    try:
        while not stop.is_set():
            start = time.perf_counter()
            status, _ = client.request("GET", "/v1/gpus")
            if status == 200:
                samples.append(time.perf_counter() - start)
    finally:
        client.close()


def sample_rss(agent: RunningAgent, stop: threading.Event, peak: list[int]) -> None:
    while not stop.wait(0.2):
        peak[0] = max(peak[0], agent.rss_kib())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()

    sandboxes: list[Sandbox] = []
    with tempfile.TemporaryDirectory(prefix="bench-agent-load-") as tmp:
        agent = start_agent(Path(tmp) / "state", simulate=args.gpus)
        try:
            for _ in range(args.clients):
                sandboxes.append(
                    Sandbox.start(
                        SandboxSpec(("sleep", "100000"), cgroup_parent=PARENT, name_prefix="bench")
                    )
                )
            idle_gpus: list[float] = []
            quiet = threading.Event()
            probe = threading.Thread(target=poll_gpus, args=(agent, quiet, idle_gpus))
            probe.start()
            time.sleep(2.0)
            quiet.set()
            probe.join()
            idle_rss = agent.rss_kib()

            stop = threading.Event()
            tally = Tally()
            loaded_gpus: list[float] = []
            peak = [idle_rss]
            threads = [
                threading.Thread(target=cycle, args=(agent, box.pid, stop, tally))
                for box in sandboxes
            ]
            threads.append(threading.Thread(target=poll_gpus, args=(agent, stop, loaded_gpus)))
            threads.append(threading.Thread(target=sample_rss, args=(agent, stop, peak)))
            cpu_before = agent.cpu_seconds()
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            time.sleep(args.seconds)
            stop.set()
            for thread in threads:
                thread.join(timeout=120)
            elapsed = time.perf_counter() - started
            cpu = agent.cpu_seconds() - cpu_before
        finally:
            for box in sandboxes:
                box.stop()
            agent.stop()

    cycles = len(tally.detach)
    print(
        f"{args.clients} clients, {args.gpus} simulated GPUs, {elapsed:.1f} s "
        f"({sys.platform}, load {Path('/proc/loadavg').read_text().split()[0]})"
    )
    print(f"  attach/detach cycles completed     {cycles} ({cycles / elapsed:.1f}/s)")
    print(f"  attach (201)                       {summary(tally.attach)}")
    print(f"  detach (204)                       {summary(tally.detach)}")
    print(f"  refused, no GPU free (409)         {summary(tally.refused)}")
    print(f"  GET /v1/gpus at idle               {summary(idle_gpus)}")
    print(f"  GET /v1/gpus under load            {summary(loaded_gpus)}")
    print(f"  agent RSS idle / peak under load   {idle_rss / 1024:.1f} / {peak[0] / 1024:.1f} MiB")
    requests = len(tally.attach) + len(tally.detach) + len(tally.refused) + len(loaded_gpus)
    print(
        f"  agent CPU under load               {cpu / elapsed * 100:.0f}% of one core, "
        f"{cpu / max(requests, 1) * 1000:.2f} ms per request ({requests} requests)"
    )
    print(f"  unexpected answers                 {len(tally.errors)}")
    for error in tally.errors[:5]:
        print(f"    {error}")
    return 0 if not tally.errors else 1


if __name__ == "__main__":
    sys.exit(main())
