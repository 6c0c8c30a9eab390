"""A separate process that holds a ledger, for the crash and locking tests of ``test_ledger``.

Run as ``python -m tests.agent._ledger_child MODE STATE_DIR``; it reports progress one line at a
time on stdout so the test can act at a known moment (and kill it with SIGKILL).

Modes:
- ``hold``: open the ledger (print ``owner``) or fail (print ``locked <pid>``); an owner keeps
  it until stdin closes.
- ``block-in-reserve``: commit one reservation (print ``committed``), then start a second one
  whose clock blocks inside the transaction (print ``blocking``) until killed.
- ``churn``: reserve, grant, release pairs of GPUs forever, printing each round's number.
"""

from __future__ import annotations

import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

from jupyter_gpu_hotplug._structs import GpuUuid, PidTarget, RequestId
from jupyter_gpu_hotplug.agent.core.seams import ContainerKey, GpuRecord
from jupyter_gpu_hotplug.agent.local.ledger import Ledger, LedgerLocked

GPUS = [
    GpuRecord(GpuUuid(f"GPU-00000000-0000-0000-0000-00000000000{i}"), i, i, "sim") for i in range(4)
]
KEY = ContainerKey("local:test-container")
NEW_GPU = GpuRecord(GpuUuid("GPU-00000000-0000-0000-0000-0000000000ff"), 9, 9, "new")


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def hold(state_dir: Path) -> None:
    try:
        ledger = Ledger.open(state_dir)
    except LedgerLocked as e:
        say(f"locked {e.holder_pid}")
        return
    with ledger:
        say("owner")
        sys.stdin.read()


def block_in_reserve(state_dir: Path) -> None:
    calls = 0

    def clock() -> datetime:
        nonlocal calls
        calls += 1
        if calls > 1:
            say("blocking")
            threading.Event().wait()
        return datetime.now(UTC)

    ledger = Ledger.open(state_dir, clock=clock)
    ledger.reserve(
        PidTarget(100, 1), 1, container=KEY, candidates=GPUS, request_id=RequestId("first")
    )
    say("committed")
    ledger.reserve(PidTarget(200, 1), 2, container=KEY, candidates=[*GPUS, NEW_GPU])


def churn(state_dir: Path) -> None:
    ledger = Ledger.open(state_dir)
    target = PidTarget(300, 1)
    for round_number in range(10**9):
        entries = ledger.reserve(
            target, 2, container=KEY, candidates=GPUS, request_id=RequestId(f"r{round_number}")
        )
        uuids = [entry.gpu.uuid for entry in entries]
        ledger.mark_granted(uuids)
        ledger.begin_release(uuids)
        ledger.release(uuids)
        say(str(round_number))


if __name__ == "__main__":
    mode, state = sys.argv[1], Path(sys.argv[2])
    {"hold": hold, "block-in-reserve": block_in_reserve, "churn": churn}[mode](state)
