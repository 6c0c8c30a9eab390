"""Attach and detach latency of two agents side by side: one build against another, fairly.

Run as root on a host with cgroups, from the checkout whose agent is "B":

    .venv/bin/python benchmarks/bench_agent_ab.py --a /path/to/other/checkout/.venv/bin/python

or, as a regression check against a commit of this repository (its tree is exported with
``git archive`` into a temporary directory and put first on ``PYTHONPATH`` of this interpreter,
so A and B run the same Python and packages):

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_agent_ab.py --a-commit main --runs 300

Why interleaved: on a shared machine the load changes from one second to the next, so two
benchmark runs one after the other compare the machine as much as the code. Here both agents run
at once (``--simulate 8``, each with a sandbox of its own) and the client alternates one attach
and detach cycle on A with one on B, ``--runs`` times, on one persistent connection each: every
moment of load is shared by both sides. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _agent import Client, RunningAgent, start_agent, summary

from jupyter_gpu_hotplug.linux.sandbox.runtime import Sandbox, SandboxSpec

PARENT = "gpu-hotplug-sandboxes/bench-agent-ab"
REPO = Path(__file__).resolve().parent.parent


def cycle(client: Client, pid: int) -> tuple[float, float]:
    """One attach and one detach of one GPU; their latencies in seconds."""
    start = time.perf_counter()
    status, body = client.request("POST", "/v1/attachments", {"count": 1, "target": {"pid": pid}})
    attach = time.perf_counter() - start
    assert status == 201, body
    uuid = body["attachments"][0]["uuid"]  # type: ignore[index]
    start = time.perf_counter()
    status, body = client.request("DELETE", f"/v1/attachments/{uuid}")
    detach = time.perf_counter() - start
    assert status == 204, body
    return attach, detach


def commit_python(commit: str, into: Path) -> str:
    """An interpreter that runs ``commit``'s agent: the commit's tree, exported from this
    repository, first on ``PYTHONPATH`` of this very interpreter (a small shell script)."""
    tree = into / "tree"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    wrapper = into / "python"
    wrapper.write_text(
        f'#!/bin/sh\nPYTHONPATH={shlex.quote(str(tree))} exec {shlex.quote(sys.executable)} "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    other = parser.add_mutually_exclusive_group(required=True)
    other.add_argument("--a", help="the python of the other checkout (A)")
    other.add_argument("--a-commit", help="A is this commit of this repository (git archive)")
    parser.add_argument("--b", default=sys.executable, help="the python of B (default: this)")
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-agent-ab-") as tmp:
        if args.a_commit is not None:
            (Path(tmp) / "commit").mkdir()
            args.a = commit_python(args.a_commit, Path(tmp) / "commit")
        agents: dict[str, RunningAgent] = {}
        boxes: dict[str, Sandbox] = {}
        load_before = Path("/proc/loadavg").read_text().split()[0]
        try:
            for side, python in (("A", args.a), ("B", args.b)):
                (Path(tmp) / side).mkdir()
                agents[side] = start_agent(Path(tmp) / side / "state", simulate=8, python=python)
                boxes[side] = Sandbox.start(
                    SandboxSpec(("sleep", "100000"), cgroup_parent=PARENT, name_prefix="ab")
                )
            clients = {side: agent.client() for side, agent in agents.items()}
            samples: dict[str, tuple[list[float], list[float]]] = {"A": ([], []), "B": ([], [])}
            for run in range(args.runs):
                order = ("A", "B") if run % 2 == 0 else ("B", "A")
                for side in order:
                    attach, detach = cycle(clients[side], boxes[side].pid)
                    samples[side][0].append(attach)
                    samples[side][1].append(detach)
            for client in clients.values():
                client.close()
        finally:
            for box in boxes.values():
                box.stop()
            for agent in agents.values():
                agent.stop()
    load = Path("/proc/loadavg").read_text().split()[0]
    print(
        f"one GPU, {args.runs} interleaved cycles per side, simulated GPUs, "
        f"load {load_before} before, {load} after"
    )
    print(f"  A = {args.a_commit or args.a}\n  B = {args.b}")
    for side in ("A", "B"):
        attaches, detaches = samples[side]
        print(f"  {side} POST /v1/attachments            {summary(attaches)}")
        print(f"  {side} DELETE /v1/attachments/UUID     {summary(detaches)}")
    for name, index in (("attach", 0), ("detach", 1)):
        a, b = statistics.median(samples["A"][index]), statistics.median(samples["B"][index])
        print(f"  median {name}: B - A = {(b - a) * 1000:+.2f} ms ({(b / a - 1) * 100:+.0f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
