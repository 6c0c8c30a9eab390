"""How fast a freed GPU reaches the first waiter of the wait queue, through the agent's API.

Run as root on a host with cgroups:

    .venv/bin/python benchmarks/bench_queue_handoff.py [--runs 50]

Starts a local agent (``--simulate 1``) and two sandboxed processes. Each cycle: the holder
attaches the GPU, the waiter asks for it with ``wait_seconds`` (it joins the queue; the
benchmark waits until ``GET /v1/queue`` shows it), then the holder detaches. Timed: from the
moment the ``DELETE`` is sent until the waiter's ``POST`` answers 201 — the detach itself, the
queue's wake-up and the waiter's whole attach. For comparison, a plain attach of a free GPU is
timed too. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

from _agent import Client, start_agent, summary

from jupyter_gpu_hotplug.linux.sandbox.runtime import Sandbox, SandboxSpec

PARENT = "gpu-hotplug-sandboxes/bench-queue-handoff"


def sandbox() -> Sandbox:
    return Sandbox.start(
        SandboxSpec(("sleep", "100000"), cgroup_parent=PARENT, name_prefix="bench")
    )


def _wait_for_gpu(client: Client, pid: int, answer: list[tuple[int, object, float]]) -> None:
    """The waiter's attach (it queues); its answer and when it came go to ``answer``."""
    status, body = client.request(
        "POST", "/v1/attachments", {"count": 1, "target": {"pid": pid}, "wait_seconds": 60}
    )
    answer.append((status, body, time.perf_counter()))


def cycles(runs: int) -> tuple[list[float], list[float]]:
    with tempfile.TemporaryDirectory(prefix="bench-queue-") as tmp:
        agent = start_agent(Path(tmp) / "state", simulate=1)
        holder, waiter = sandbox(), sandbox()
        try:
            client, waiting_client = agent.client(), agent.client()
            handoff: list[float] = []
            plain: list[float] = []
            for _ in range(runs):
                start = time.perf_counter()
                status, body = client.request(
                    "POST", "/v1/attachments", {"count": 1, "target": {"pid": holder.pid}}
                )
                plain.append(time.perf_counter() - start)
                assert status == 201, body
                uuid = body["attachments"][0]["uuid"]  # type: ignore[index]
                answer: list[tuple[int, object, float]] = []
                thread = threading.Thread(
                    target=_wait_for_gpu, args=(waiting_client, waiter.pid, answer)
                )
                thread.start()
                while True:
                    _, view = client.request("GET", f"/v1/queue?pid={waiter.pid}")
                    if view["requests"]:  # type: ignore[index]
                        break
                    time.sleep(0.001)
                released = time.perf_counter()
                status, body = client.request("DELETE", f"/v1/attachments/{uuid}")
                assert status == 204, body
                thread.join(60)
                status, body, served = answer[0]
                assert status == 201, body
                handoff.append(served - released)
                status, body = client.request("DELETE", f"/v1/attachments?pid={waiter.pid}")
                assert status == 204, body
            return handoff, plain
        finally:
            holder.stop()
            waiter.stop()
            agent.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    handoff, plain = cycles(args.runs)
    print(f"one simulated GPU, {args.runs} cycles")
    print(f"  attach of a free GPU              {summary(plain)}")
    print(f"  detach sent -> first waiter's 201 {summary(handoff)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
