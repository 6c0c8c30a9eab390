"""A bounded loopback soak of the agent: valid and hostile traffic mixed, then a leak check.

Run as root on a host with cgroups:

    .venv/bin/python benchmarks/bench_soak.py [--clients 6] [--hostile 4] [--idle 150] \
        [--hog 64] [--slow-bodies 512] [--seconds 30]

Starts a local agent with ``--simulate 4`` and one sandboxed process per valid client. For
``--seconds``: each valid client cycles attach / ``GET /v1/gpus`` / detach on its sandbox over
one persistent connection; each hostile client sends, on fresh connections, what the fuzzing
tier sends (huge numbers, deep nesting, duplicate keys, an oversized declared body, an
oversized chunked body, a body that never comes); ``--idle`` connections are opened and
left silent, to be closed by the agent's idle timeout; and two abusers of the connection
caps (issue 25) run all along: one sandboxed container that keeps ``--hog`` connections to
the agent's unix socket open with a body that never comes (it opens a new one whenever one is
closed), and ``--slow-bodies`` connections from 127.0.0.2-127.0.0.9 that send their headers
without credentials and then a byte of body a second (likewise replaced when answered).
Printed: p50/p99 of each kind of answer, every status seen, the number of 5xx to well-behaved
callers (must be 0), and the leak check after the soak
and a quiet period: the agent's open file descriptors, threads and RSS against their values
before, the ledger (every GPU free again) and each sandbox's device access (as at start).
Figures are printed, never asserted; the exit status is 1 if a well-behaved caller got a 5xx
or a leak was seen (a documented 503 with ``Retry-After`` to an abuser is counted apart).
The interpreter's environment picks the checkout that runs (``PYTHONPATH``), so the same
script measures an older commit's agent for a before/after comparison.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import http.client
import json
import os
import select
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from _agent import RunningAgent, percentile, remove_parent_cgroups, start_agent

from jupyter_gpu_hotplug.linux import cgroup_v1, cgroup_v2
from jupyter_gpu_hotplug.linux.sandbox.runtime import Sandbox, SandboxSpec

PARENT = "gpu-hotplug-sandboxes/bench-soak"
QUIET_SECONDS = 35.0  # longer than the agent's idle timeout (30 s before issue 25, 10 s now)
SLOW_SOURCES = [f"127.0.0.{n}" for n in range(2, 10)]
SLOW_BODY = b"POST /v1/attachments HTTP/1.1\r\nHost: soak\r\nContent-Length: 100\r\n\r\n{"
HOG = """
import select, socket, sys, time
path, count = sys.argv[1], int(sys.argv[2])
head = b"POST /v1/attachments HTTP/1.1\\r\\nHost: hog\\r\\nContent-Length: 100\\r\\n\\r\\n{"
held = []
while True:
    while len(held) < count:
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.connect(path)
            sock.sendall(head)
        except OSError:
            sock.close()
            time.sleep(0.05)
            continue
        held.append(sock)
    for sock in select.select(held, [], [], 0.5)[0]:  # answered or closed: open another
        held.remove(sock)
        sock.close()
"""
"""One container holding its connections: runs in a sandbox, as a kernel would."""


def _hostile(token: str) -> list[tuple[str, bytes]]:
    auth = f"Authorization: Bearer {token}\r\n".encode()
    post = b"POST /v1/attachments HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n" + auth

    def body(data: bytes) -> bytes:
        return post + b"Content-Length: %d\r\n\r\n" % len(data) + data

    chunk = b"x" * 8192
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(10)) + b"0\r\n\r\n"
    return [
        ("huge number", body(b'{"count": 1' + b"0" * 5000 + b"}")),
        ("deep nesting", body(b'{"count": 1, "request_id": ' + b"[" * 5000 + b"]" * 5000 + b"}")),
        ("duplicate keys", body(b'{"count": 1, "count": 2}')),
        (
            "path in a field",
            body(b'{"count": 1, "target": {"pod": {"namespace": "../..", "name": "x"}}}'),
        ),
        ("declared 50 MB", post + b"Content-Length: 52428800\r\n\r\n{"),
        ("chunked 80 KiB", post + b"Transfer-Encoding: chunked\r\n\r\n" + chunked),
    ]


@dataclass
class Tally:
    latency: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, kind: str, status: int | None, elapsed: float) -> None:
        with self.lock:
            self.latency[kind].append(elapsed)
            self.statuses[f"{kind} -> {status}"] += 1


def valid_client(agent: RunningAgent, pid: int, stop: threading.Event, tally: Tally) -> None:
    """Attach, list, detach, over and over; a call the agent drops even after the client's one
    reconnection is recorded as ``None`` (what a user sees as "connection reset")."""
    client = agent.client()

    def call(kind: str, method: str, path: str, body: object = None) -> tuple[int | None, object]:
        start = time.perf_counter()
        try:
            status, answer = client.request(method, path, body)
        except (http.client.HTTPException, ConnectionError):
            status, answer = None, None
        tally.record(kind, status, time.perf_counter() - start)
        return status, answer

    try:
        while not stop.is_set():
            status, body = call(
                "attach", "POST", "/v1/attachments", {"count": 1, "target": {"pid": pid}}
            )
            call("GET /v1/gpus", "GET", "/v1/gpus")
            if status == 201:
                uuid = body["attachments"][0]["uuid"]  # type: ignore[index]
                while call("detach", "DELETE", f"/v1/attachments/{uuid}")[0] not in (204, 404):
                    if stop.is_set():
                        break
    finally:
        client.close()


def hostile_client(
    port: int, cases: list[tuple[str, bytes]], stop: threading.Event, tally: Tally
) -> None:
    while not stop.is_set():
        for kind, request in cases:
            start = time.perf_counter()
            tally.record(f"hostile: {kind}", _exchange(port, request), time.perf_counter() - start)


def slow_bodies(port: int, count: int, stop: threading.Event, tally: Tally) -> None:
    """``count`` connections from 127.0.0.2-9 sending a body a byte a second, without
    credentials; each one answered or closed is recorded and replaced."""
    held: dict[socket.socket, float] = {}

    def open_one(source: str) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((source, 0))
            sock.connect(("127.0.0.1", port))
            sock.sendall(SLOW_BODY)
        except OSError:
            sock.close()
            return
        held[sock] = time.perf_counter()

    sources = [SLOW_SOURCES[n % len(SLOW_SOURCES)] for n in range(count)]
    while not stop.is_set():
        for source in sources[len(held) :]:
            open_one(source)
        for sock in select.select(list(held), [], [], 1.0)[0]:
            started = held.pop(sock)
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.") else None
            tally.record("hostile: slow body", status, time.perf_counter() - started)
            sock.close()
        for sock in list(held):
            with contextlib.suppress(OSError):
                sock.send(b" ")
    for sock in held:
        sock.close()


def _exchange(port: int, request: bytes) -> int | None:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        # Answered (and closed) before the whole request was sent: read what it said.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
                if b"\r\n\r\n" in data:
                    break
        except ConnectionResetError:
            pass
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.") else None


@dataclass(frozen=True)
class Footprint:
    fds: int
    threads: int
    rss_kib: int

    def __str__(self) -> str:
        return f"{self.fds}/{self.threads}/{self.rss_kib // 1024} MiB"

    @classmethod
    def of(cls, agent: RunningAgent) -> Footprint:
        pid = agent.process.pid
        threads = len(os.listdir(f"/proc/{pid}/task"))
        return cls(len(os.listdir(f"/proc/{pid}/fd")), threads, agent.rss_kib())


def device_access(box: Sandbox) -> tuple[str, ...]:
    rules: list[str] = []
    if box.cgroups.v1 is not None:
        rules += [str(r) for r in cgroup_v1.read_allow_list(box.cgroups.v1)]
    if box.cgroups.v2 is not None:
        rules += [f"v2 {r}" for r in cgroup_v2.granted_devices(box.cgroups.v2)]
    rules += [f"/dev/{n}" for n in os.listdir(f"/proc/{box.pid}/root/dev")]
    return tuple(sorted(rules))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--hostile", type=int, default=4)
    parser.add_argument("--idle", type=int, default=150)
    parser.add_argument("--hog", type=int, default=64)
    parser.add_argument("--slow-bodies", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()

    tally = Tally()
    sandboxes: list[Sandbox] = []
    hog: Sandbox | None = None
    # Outside /tmp, which a sandbox sees as its own: the hog must reach the socket.
    socket_path = Path(f"/run/gpu-hotplug-bench-soak-{os.getpid()}.sock")
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        agent = start_agent(Path(tmp) / "state", simulate=4, extra=[f"--listen=unix:{socket_path}"])
        try:
            for _ in range(args.clients):
                spec = SandboxSpec(("sleep", "100000"), cgroup_parent=PARENT, name_prefix="soak")
                sandboxes.append(Sandbox.start(spec))
            if args.hog:
                argv = (sys.executable, "-c", HOG, str(socket_path), str(args.hog))
                hog = Sandbox.start(SandboxSpec(argv, cgroup_parent=PARENT, name_prefix="hog"))
            access_before = {box.pid: device_access(box) for box in sandboxes}
            agent.client().request("GET", "/v1/gpus")
            before = Footprint.of(agent)

            idle = [socket.create_connection(("127.0.0.1", agent.port)) for _ in range(args.idle)]
            stop = threading.Event()
            cases = _hostile(agent.token)
            threads = [
                threading.Thread(target=valid_client, args=(agent, box.pid, stop, tally))
                for box in sandboxes
            ] + [
                threading.Thread(target=hostile_client, args=(agent.port, cases, stop, tally))
                for _ in range(args.hostile)
            ]
            if args.slow_bodies:
                threads.append(
                    threading.Thread(
                        target=slow_bodies, args=(agent.port, args.slow_bodies, stop, tally)
                    )
                )
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            time.sleep(args.seconds)
            stop.set()
            for thread in threads:
                thread.join(timeout=120)
            elapsed = time.perf_counter() - started
            under_load = Footprint.of(agent)
            if hog is not None:  # its connections are not the agent's leak
                hog.stop()
                hog = None
            idle_closed = sum(1 for sock in idle if _closed_by_peer(sock))
            for sock in idle:
                sock.close()
            time.sleep(QUIET_SECONDS)
            after = Footprint.of(agent)
            _, listed = agent.client().request("GET", "/v1/gpus")
            states = collections.Counter(g["state"] for g in listed["gpus"])  # type: ignore[index]
            access_after = {box.pid: device_access(box) for box in sandboxes}
        finally:
            for box in [*sandboxes, *([hog] if hog is not None else [])]:
                box.stop()
            agent.stop()
            remove_parent_cgroups(PARENT)

    load = Path("/proc/loadavg").read_text().split()[0]
    print(
        f"soak: {args.clients} valid + {args.hostile} hostile clients, {args.idle} idle "
        f"connections, a container holding {args.hog}, {args.slow_bodies} slow bodies from "
        f"8 addresses, 4 simulated GPUs, {elapsed:.1f} s (load {load})"
    )
    print(f"  {'kind':32} {'n':>6} {'p50 ms':>9} {'p99 ms':>9}")
    for kind, samples in sorted(tally.latency.items()):
        print(
            f"  {kind:32} {len(samples):6d} {percentile(samples, 0.5) * 1000:9.2f} "
            f"{percentile(samples, 0.99) * 1000:9.2f}"
        )
    print("  statuses:", json.dumps(dict(sorted(tally.statuses.items()))))
    server_errors = sum(
        n
        for key, n in tally.statuses.items()
        if key.split("-> ")[1].startswith("5") and not key.startswith("hostile:")
    )
    abused = sum(
        n for key, n in tally.statuses.items() if key.startswith("hostile:") and key.endswith("503")
    )
    well = [s for kind, v in tally.latency.items() if not kind.startswith("hostile:") for s in v]
    print(
        f"  well-behaved callers: {len(well)} answers, p99 {percentile(well, 0.99) * 1000:.2f} ms"
    )
    dropped = sum(
        n
        for key, n in tally.statuses.items()
        if key.endswith("-> None") and not key.startswith("hostile:")
    )
    print(f"  5xx answers to well-behaved callers: {server_errors}; 503 to abusers: {abused}")
    print(f"  well-behaved calls dropped (connection reset or closed): {dropped}")
    print(f"  idle connections closed by the agent during the soak: {idle_closed} of {args.idle}")
    print(
        f"  agent fds/threads/RSS: before {before}, under load {under_load}, "
        f"after {QUIET_SECONDS:.0f} s quiet {after}"
    )
    leaked = after.fds > before.fds or states != collections.Counter({"free": 4})
    leaked = leaked or access_after != access_before
    unchanged = access_after == access_before
    print(f"  ledger after: {dict(states)}; sandboxes' device access as at start: {unchanged}")
    print(f"  leaks: {'YES' if leaked else 'none'}")
    return 1 if server_errors or dropped or leaked else 0


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


if __name__ == "__main__":
    sys.exit(main())
