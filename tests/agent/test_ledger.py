"""The local-mode ledger: allocation, idempotency, state transitions, locking, crash safety."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import selectors
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from jupyter_gpu_hotplug._structs import GpuUuid, PidTarget, PodTarget, RequestId
from jupyter_gpu_hotplug.agent.core.errors import Busy, InsufficientGpus, NotFound
from jupyter_gpu_hotplug.agent.core.seams import (
    GpuRecord,
    IllegalTransition,
    Reservation,
    ReservationState,
    Suspension,
    SuspensionState,
)
from jupyter_gpu_hotplug.agent.local import ledger as ledger_module
from jupyter_gpu_hotplug.agent.local.ledger import (
    LEDGER_FILE,
    LOCK_FILE,
    MIGRATIONS,
    Ledger,
    LedgerError,
    LedgerLocked,
)

from ._ledger_child import GPUS, KEY, NEW_GPU

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2025, 1, 1, tzinfo=UTC)
ALICE = PodTarget("jhub", "jupyter-alice", "notebook")
BOB = PidTarget(4242, 1000)


class FakeClock:
    """Deterministic time: each reading is one second after the previous."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ledger(state_dir: Path, clock: FakeClock) -> Iterator[Ledger]:
    with Ledger.open(state_dir, clock=clock) as opened:
        yield opened


def free(ledger: Ledger, candidates: list[GpuRecord]) -> list[GpuRecord]:
    """Those of ``candidates`` no attachment holds."""
    taken = {entry.gpu.uuid for entry in ledger.attachments()}
    return [gpu for gpu in candidates if gpu.uuid not in taken]


def known(ledger: Ledger) -> list[GpuRecord]:
    """The GPU records the ledger keeps (read straight from its database)."""
    with contextlib.closing(sqlite3.connect(ledger.db_path)) as raw:
        rows = raw.execute("SELECT uuid, idx, minor, name FROM gpus").fetchall()
    return [GpuRecord(GpuUuid(u), i, m, n) for u, i, m, n in rows]


def uuids(entries: list[Reservation]) -> list[GpuUuid]:
    return [entry.gpu.uuid for entry in entries]


# --- opening -------------------------------------------------------------------------------------


def test_open_creates_private_files(ledger: Ledger, state_dir: Path) -> None:
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((state_dir / LEDGER_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE((state_dir / LOCK_FILE).stat().st_mode) == 0o600
    assert (state_dir / LOCK_FILE).read_text().strip() == str(os.getpid())


def test_schema_and_journal(ledger: Ledger, state_dir: Path) -> None:
    with sqlite3.connect(state_dir / LEDGER_FILE) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert raw.execute("PRAGMA user_version").fetchone() == (len(MIGRATIONS),)
    raw.close()


def test_connections_survive_a_process_crash(tmp_path: Path) -> None:
    # WAL with synchronous=NORMAL: commits survive the process's death (the kill tests below
    # prove it); only an OS crash could drop the last ones, which the module docstring covers.
    conn = ledger_module._connect(tmp_path / "x.sqlite3")
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    finally:
        conn.close()


def test_second_open_is_refused_with_the_holder(ledger: Ledger, state_dir: Path) -> None:
    with pytest.raises(LedgerLocked) as caught:
        Ledger.open(state_dir)
    assert caught.value.holder_pid == os.getpid()
    assert f"process {os.getpid()}" in str(caught.value)
    assert "another state dir" in str(caught.value)


def test_close_releases_the_dir(state_dir: Path) -> None:
    Ledger.open(state_dir).close()
    with Ledger.open(state_dir) as again:
        assert again.attachments() == []


def test_closed_ledger_refuses_calls(state_dir: Path) -> None:
    opened = Ledger.open(state_dir)
    opened.close()
    opened.close()  # idempotent
    with pytest.raises(LedgerError, match="closed"):
        opened.attachments()
    with pytest.raises(LedgerError, match="closed"):
        opened.reserve(BOB, 1, container=KEY, candidates=GPUS)


def test_newer_schema_is_refused(state_dir: Path) -> None:
    Ledger.open(state_dir).close()
    with sqlite3.connect(state_dir / LEDGER_FILE) as raw:
        raw.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    raw.close()
    with pytest.raises(LedgerError, match="newer than this agent knows"):
        Ledger.open(state_dir)
    # The failed open let go of the lock.
    with pytest.raises(LedgerError, match="newer"):
        Ledger.open(state_dir)


def test_migrations_run_once_in_order(state_dir: Path) -> None:
    with Ledger.open(state_dir) as first:
        first.reserve(BOB, 1, container=KEY, candidates=GPUS)
    runs: list[int] = []

    def add_note(conn: sqlite3.Connection) -> None:
        runs.append(1)
        conn.execute("ALTER TABLE attachments ADD COLUMN note TEXT")

    upgraded = [*MIGRATIONS, add_note]
    with Ledger.open(state_dir, migrations=upgraded) as second:
        assert len(second.attachments()) == 1  # data kept across the upgrade
    with Ledger.open(state_dir, migrations=upgraded):
        pass
    assert runs == [1]
    with sqlite3.connect(state_dir / LEDGER_FILE) as raw:
        assert raw.execute("PRAGMA user_version").fetchone() == (len(upgraded),)
        columns = [row[1] for row in raw.execute("PRAGMA table_info(attachments)")]
    raw.close()
    assert "note" in columns


def test_failed_migration_changes_nothing(state_dir: Path) -> None:
    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE half_done (x INTEGER)")
        conn.execute("THIS IS NOT SQL")

    with pytest.raises(LedgerError, match="cannot open the ledger") as caught:
        Ledger.open(state_dir, migrations=[*MIGRATIONS, broken])
    assert isinstance(caught.value.__cause__, sqlite3.Error)
    with sqlite3.connect(state_dir / LEDGER_FILE) as raw:
        assert raw.execute("PRAGMA user_version").fetchone() == (0,)
        tables = {row[0] for row in raw.execute("SELECT name FROM sqlite_master")}
    raw.close()
    assert "half_done" not in tables
    assert "gpus" not in tables


def test_corrupt_file_is_a_ledger_error(state_dir: Path) -> None:
    state_dir.mkdir()
    (state_dir / LEDGER_FILE).write_bytes(b"this is not a database" * 100)
    for _ in range(2):  # the second try proves the first released the lock
        with pytest.raises(LedgerError, match="cannot open the ledger") as caught:
            Ledger.open(state_dir)
        assert not isinstance(caught.value, LedgerLocked)
        assert isinstance(caught.value.__cause__, sqlite3.DatabaseError)


def test_tampered_rows_are_a_ledger_error(ledger: Ledger, state_dir: Path) -> None:
    ledger.reserve(ALICE, 1, container=KEY, candidates=GPUS)
    with sqlite3.connect(state_dir / LEDGER_FILE) as raw:
        raw.execute("UPDATE attachments SET target_key = 'somebody'")
    raw.close()
    with pytest.raises(LedgerError, match="corrupt") as caught:
        ledger.attachments()
    assert isinstance(caught.value.__cause__, ValueError)


def test_state_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("")
    with pytest.raises(LedgerError, match="cannot lock the state dir") as caught:
        Ledger.open(tmp_path / "state")
    assert isinstance(caught.value.__cause__, OSError)


# --- reserving -----------------------------------------------------------------------------------


def test_reserve_takes_free_gpus_in_candidate_order(ledger: Ledger) -> None:
    preference = [GPUS[2], GPUS[0], GPUS[1], GPUS[3]]
    entries = ledger.reserve(
        ALICE, 2, container=KEY, candidates=preference, request_id=RequestId("a-1")
    )
    assert {entry.gpu for entry in entries} == {GPUS[2], GPUS[0]}
    assert uuids(entries) == [GPUS[0].uuid, GPUS[2].uuid]  # reported in index order
    for entry in entries:
        assert entry.target == ALICE
        assert entry.state is ReservationState.RESERVING
        assert entry.request_id == "a-1"
        assert entry.container == KEY
        assert entry.created_at == T0 + timedelta(seconds=1)
        assert entry.granted_at is None
    assert uuids(ledger.reserve(BOB, 2, container=KEY, candidates=preference)) == [
        GPUS[1].uuid,
        GPUS[3].uuid,
    ]


def test_insufficient_gpus_changes_nothing(ledger: Ledger) -> None:
    ledger.reserve(ALICE, 3, container=KEY, candidates=GPUS)
    with pytest.raises(InsufficientGpus) as caught:
        ledger.reserve(BOB, 3, container=KEY, candidates=[*GPUS, NEW_GPU])
    assert (caught.value.free, caught.value.requested) == (2, 3)
    assert ledger.attachments(BOB) == []
    assert NEW_GPU not in known(ledger)  # its record was rolled back too
    assert len(ledger.attachments()) == 3


def test_only_candidates_are_handed_out(ledger: Ledger) -> None:
    with pytest.raises(InsufficientGpus) as caught:
        ledger.reserve(ALICE, 2, container=KEY, candidates=GPUS[:1])
    assert caught.value.free == 1
    with pytest.raises(InsufficientGpus):
        ledger.reserve(ALICE, 1, container=KEY, candidates=[])


def test_request_ids_are_recorded_not_interpreted(ledger: Ledger) -> None:
    # Whether an attach repeats an earlier one is the service's decision (``_served``).
    first = ledger.reserve(ALICE, 1, container=KEY, candidates=GPUS, request_id=RequestId("r"))
    again = ledger.reserve(ALICE, 1, container=KEY, candidates=GPUS, request_id=RequestId("r"))
    assert set(uuids(again)).isdisjoint(uuids(first))
    assert [entry.request_id for entry in ledger.attachments(ALICE)] == ["r", "r"]


def test_a_reused_pid_is_another_target(ledger: Ledger) -> None:
    old = PidTarget(777, 10)
    ledger.reserve(old, 1, container=KEY, candidates=GPUS, request_id=RequestId("r"))
    newcomer = PidTarget(777, 99)
    assert ledger.attachments(newcomer) == []
    (fresh,) = ledger.reserve(
        newcomer, 1, container=KEY, candidates=GPUS, request_id=RequestId("r")
    )
    assert fresh.target == newcomer
    assert [entry.target for entry in ledger.attachments(old)] == [old]


def test_gpu_records_follow_the_inventory(ledger: Ledger) -> None:
    ledger.reserve(ALICE, 1, container=KEY, candidates=GPUS)
    moved = GpuRecord(GPUS[0].uuid, 0, 7, "renamed")
    (bob,) = ledger.reserve(BOB, 1, container=KEY, candidates=[moved, *GPUS[1:]])
    (alice,) = ledger.attachments(ALICE)
    assert alice.gpu == moved
    assert bob.gpu == GPUS[1]


@pytest.mark.parametrize(
    ("count", "candidates", "message"),
    [(0, GPUS, "at least 1"), (-1, GPUS, "at least 1"), (1, [GPUS[0], GPUS[0]], "more than once")],
    ids=["zero", "negative", "same-gpu-twice"],
)
def test_programming_errors(
    ledger: Ledger, count: int, candidates: list[GpuRecord], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ledger.reserve(ALICE, count, container=KEY, candidates=candidates)


def test_duplicate_uuids_with_different_records(ledger: Ledger) -> None:
    twin = GpuRecord(GPUS[0].uuid, 5, 5, "twin")
    with pytest.raises(ValueError, match="more than once"):
        ledger.reserve(ALICE, 1, container=KEY, candidates=[GPUS[0], twin])


def test_naive_clock_is_refused(state_dir: Path) -> None:
    with Ledger.open(state_dir, clock=lambda: datetime(2025, 1, 1)) as naive:
        with pytest.raises(ValueError, match="timezone-aware"):
            naive.reserve(ALICE, 1, container=KEY, candidates=GPUS)
        assert naive.attachments() == []


# --- state transitions ---------------------------------------------------------------------------


def test_grant_then_release(ledger: Ledger) -> None:
    reserved = ledger.reserve(ALICE, 2, container=KEY, candidates=GPUS)
    granted = ledger.mark_granted(uuids(reserved))
    assert [entry.state for entry in granted] == [ReservationState.GRANTED] * 2
    assert all(
        entry.granted_at is not None and entry.granted_at > entry.created_at for entry in granted
    )
    assert ledger.mark_granted(uuids(reserved)) == granted  # repeating changes nothing
    assert ledger.pending() == []

    (releasing,) = ledger.begin_release([reserved[0].gpu.uuid])
    assert releasing.state is ReservationState.RELEASING
    assert releasing.granted_at == granted[0].granted_at
    assert ledger.begin_release([reserved[0].gpu.uuid]) == [releasing]  # idempotent
    assert ledger.pending() == [releasing]

    ledger.release([reserved[0].gpu.uuid])
    assert ledger.get(reserved[0].gpu.uuid) is None
    assert uuids(ledger.attachments(ALICE)) == [reserved[1].gpu.uuid]
    assert free(ledger, GPUS) == [GPUS[0], GPUS[2], GPUS[3]]


def test_release_is_repeatable_and_rolls_back_reservations(ledger: Ledger) -> None:
    reserved = ledger.reserve(ALICE, 2, container=KEY, candidates=GPUS)
    ledger.release(uuids(reserved))
    ledger.release(uuids(reserved))
    ledger.release([GpuUuid("GPU-ffffffff-ffff-ffff-ffff-ffffffffffff")])
    assert ledger.attachments() == []
    assert free(ledger, GPUS) == GPUS


def test_grant_refuses_unknown_and_releasing_atomically(ledger: Ledger) -> None:
    first, second = ledger.reserve(ALICE, 2, container=KEY, candidates=GPUS)
    ledger.mark_granted([first.gpu.uuid])
    ledger.begin_release([first.gpu.uuid])
    unknown = GpuUuid("GPU-ffffffff-ffff-ffff-ffff-ffffffffffff")
    with pytest.raises(IllegalTransition, match="releasing"):
        ledger.mark_granted([first.gpu.uuid, second.gpu.uuid, unknown])
    assert ledger.get(second.gpu.uuid) == second  # untouched: all or nothing


def test_begin_release_errors(ledger: Ledger) -> None:
    with pytest.raises(NotFound) as missing:
        ledger.begin_release([GPUS[0].uuid])
    assert missing.value.resource == "attachment"
    (reserving,) = ledger.reserve(ALICE, 1, container=KEY, candidates=GPUS)
    with pytest.raises(Busy) as busy:
        ledger.begin_release([reserving.gpu.uuid])
    assert busy.value.retryable
    assert str(ALICE) in busy.value.message


def test_queries(ledger: Ledger) -> None:
    a = ledger.reserve(ALICE, 1, container=KEY, candidates=GPUS[2:])
    b = ledger.reserve(BOB, 2, container=KEY, candidates=GPUS)
    assert ledger.get(a[0].gpu.uuid) == a[0]
    assert ledger.attachments(ALICE) == a
    assert ledger.attachments(BOB) == b
    assert uuids(ledger.attachments()) == [g.uuid for g in GPUS[:3]]
    assert ledger.attachments(PodTarget("jhub", "jupyter-alice", "other")) == []


def test_changes_survive_reopening(state_dir: Path, clock: FakeClock) -> None:
    with Ledger.open(state_dir, clock=clock) as first:
        reserved = first.reserve(
            ALICE, 2, container=KEY, candidates=GPUS, request_id=RequestId("keep")
        )
        granted = first.mark_granted([reserved[0].gpu.uuid])
    with Ledger.open(state_dir, clock=clock) as second:
        assert second.attachments() == [granted[0], reserved[1]]
        assert second.pending() == [reserved[1]]
        assert set(known(second)) == set(GPUS)


# --- concurrency ---------------------------------------------------------------------------------


def test_concurrent_reservations_never_share_a_gpu(ledger: Ledger) -> None:
    barrier = threading.Barrier(8)
    won: list[GpuUuid] = []
    lost: list[InsufficientGpus] = []
    other: list[BaseException] = []

    def contend(n: int) -> None:
        barrier.wait()
        try:
            (entry,) = ledger.reserve(PidTarget(100 + n, 1), 1, container=KEY, candidates=GPUS)
            won.append(entry.gpu.uuid)
        except InsufficientGpus as e:
            lost.append(e)
        except BaseException as e:
            other.append(e)

    threads = [threading.Thread(target=contend, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert other == []
    assert sorted(won) == sorted(g.uuid for g in GPUS)
    assert len(lost) == 4
    assert {(e.free, e.requested) for e in lost} == {(0, 1)}


# --- other processes: locking and crashes --------------------------------------------------------


class Child:
    """A ``_ledger_child`` process, read line by line with a deadline, always reaped."""

    def __init__(self, mode: str, state_dir: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.agent._ledger_child", mode, str(state_dir)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        assert self.proc.stdout is not None
        self._stdout = self.proc.stdout.fileno()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._stdout, selectors.EVENT_READ)
        self._pending = b""

    def line(self, timeout: float = 60.0) -> str:
        """The next line; unbuffered reads, so a line already sent is never waited for."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._selector.select(remaining):
                raise AssertionError(f"child {self.proc.pid} said nothing for {timeout} s")
            chunk = os.read(self._stdout, 4096)
            if not chunk:
                raise AssertionError(f"child {self.proc.pid} exited: {self.proc.wait()}")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        self.kill()
        self._selector.close()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.close()


def test_one_agent_per_state_dir_across_processes(state_dir: Path, children: list[Child]) -> None:
    children.extend(Child("hold", state_dir) for _ in range(8))
    answers = [child.line() for child in children]
    owners = [child for child, answer in zip(children, answers, strict=True) if answer == "owner"]
    assert len(owners) == 1
    owner = owners[0].proc
    assert all(answer.startswith("locked ") for answer in answers if answer != "owner")
    late = Child("hold", state_dir)  # the owner has certainly written its pid by now
    children.append(late)
    assert late.line() == f"locked {owner.pid}"
    with pytest.raises(LedgerLocked) as caught:
        Ledger.open(state_dir)
    assert caught.value.holder_pid == owner.pid
    assert owner.stdin is not None
    owner.stdin.close()
    assert owner.wait(timeout=60) == 0
    with Ledger.open(state_dir) as mine:
        assert mine.attachments() == []


def test_kill_inside_a_transaction_leaves_no_trace(state_dir: Path, children: list[Child]) -> None:
    child = Child("block-in-reserve", state_dir)
    children.append(child)
    assert child.line() == "committed"
    assert child.line() == "blocking"  # inside BEGIN IMMEDIATE, GPU records already written
    with pytest.raises(LedgerLocked) as caught:
        Ledger.open(state_dir)
    assert caught.value.holder_pid == child.proc.pid
    child.kill()
    assert child.proc.returncode == -signal.SIGKILL

    with Ledger.open(state_dir) as after:  # the kernel dropped the lock with the process
        (survivor,) = after.attachments()
        assert survivor.target == PidTarget(100, 1)
        assert survivor.request_id == "first"
        assert after.pending() == [survivor]  # for start-up reconciliation
        assert after.attachments(PidTarget(200, 1)) == []
        assert NEW_GPU not in known(after)
        assert len(after.reserve(PidTarget(200, 1), 3, container=KEY, candidates=GPUS)) == 3


@pytest.mark.parametrize("cycle", range(3))
def test_kill_at_any_moment_keeps_changes_whole(
    state_dir: Path, children: list[Child], cycle: int
) -> None:
    # Each round is four short transactions back to back, so a kill after some rounds lands
    # inside or between transactions at an unpredictable point; every outcome must be whole.
    child = Child("churn", state_dir)
    children.append(child)
    rounds = 0
    while rounds < 20 + 7 * cycle:
        rounds = int(child.line()) + 1
    child.kill()

    with sqlite3.connect(state_dir / LEDGER_FILE) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        groups = raw.execute(
            "SELECT request_id, count(*) FROM attachments GROUP BY request_id"
        ).fetchall()
    raw.close()
    assert len(groups) <= 1
    assert all(count == 2 for _, count in groups)  # a pair is reserved and released as one
    with Ledger.open(state_dir) as after:
        after.release(uuids(after.attachments()))
        assert free(after, GPUS) == GPUS


# --- suspensions (issue 39) ---------------------------------------------------------------------


def test_a_suspension_is_kept_replaced_and_forgotten(state_dir: Path, clock: FakeClock) -> None:
    suspending = Suspension(
        target=BOB,
        container=KEY,
        model=GPUS[0].name,
        gpus=(GPUS[0], GPUS[1]),
        pids=(4242, 4250),
        state=SuspensionState.SUSPENDING,
        host_memory=None,
    )
    suspended = dataclasses.replace(
        suspending, state=SuspensionState.SUSPENDED, host_memory=3 * 2**30
    )
    with Ledger.open(state_dir, clock=clock) as ledger:
        assert ledger.suspension(BOB) is None
        ledger.record_suspension(suspending)
        ledger.record_suspension(suspended)
    with Ledger.open(state_dir, clock=clock) as ledger:  # durable: a restarted agent reads it
        assert ledger.suspension(BOB) == suspended
        assert ledger.suspensions() == [suspended]
        assert ledger.suspension(PidTarget(4242, 1001)) is None, "another process, same pid"
        ledger.forget_suspension(BOB)
        ledger.forget_suspension(BOB)
        assert ledger.suspensions() == []


def test_a_tampered_suspension_is_a_ledger_error(ledger: Ledger, state_dir: Path) -> None:
    ledger.record_suspension(
        Suspension(BOB, KEY, "GPU", (GPUS[0],), (1,), SuspensionState.SUSPENDED)
    )
    with contextlib.closing(sqlite3.connect(state_dir / LEDGER_FILE)) as raw, raw:
        raw.execute("UPDATE suspensions SET pids = '[\"x\"]'")
    with pytest.raises(LedgerError, match=r"suspension .* is corrupt"):
        ledger.suspensions()
