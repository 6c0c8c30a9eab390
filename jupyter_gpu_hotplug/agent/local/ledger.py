"""Local mode's durable GPU ownership: a SQLite ledger in the agent's state dir.

Why it exists: in Kubernetes mode holder pods are the durable record of who owns which GPU; in
local mode nothing outside the agent remembers, yet a crash must never leave a GPU granted to a
process that nobody accounts for (DESIGN §2, §8). So every change is written here *before* the
host is touched (``reserving``), confirmed after (``granted``), and announced before it is undone
(``releasing``); at start-up ``pending()`` shows exactly what a crash left half-done.

Durability choices: every change in one ``BEGIN IMMEDIATE`` transaction (it takes the write lock
up front, so a read-then-write such as picking free GPUs cannot race), the schema versioned with
``PRAGMA user_version`` and upgraded by an ordered list of migrations. An exclusive ``flock`` on
``<state-dir>/agent.lock``, held for the ledger's lifetime, keeps a second agent away from the
same state; the kernel drops it when the process dies, however it dies.

The journal is WAL with ``synchronous=NORMAL``: a commit writes its pages to the WAL file (into
the kernel's page cache) and returns without an ``fsync``; the WAL is synced only at
checkpoints. What that keeps and what it gives up (https://sqlite.org/pragma.html#pragma_synchronous,
https://sqlite.org/wal.html):

- Atomicity always: a transaction is in the database whole or not at all, after any crash.
- A committed change survives the death of the agent's process, however it dies (``kill -9``,
  an abort, the OOM killer): the data is in the kernel once ``COMMIT`` returns, and the kernel
  writes it out. This is the crash the ledger exists for, and the crash tests kill the agent
  at every step of an attach and detach to prove it.
- Only a crash of the operating system or a power loss can lose the last commits (the database
  then reads as it was a few transactions earlier, still consistent). That loses nothing that
  matters here: every target is a process of this host, and the permission part of every grant
  (the device cgroup rules and eBPF programs) lives only in its running kernel, so the same
  event ends every target and takes every permission away. At start-up the reconciler finds
  each target gone (pid and start time no longer match) and releases its GPUs, whatever state
  the rows are in; a row that was lost belonged to such a target too. No GPU can be usable
  without a row.

``synchronous=FULL`` would add one ``fsync`` per commit (two per attach and per detach: ≈ 0.5 ms
each on an idle disk, several ms under load) to protect against a case that already has a
complete answer.

The ledger is synchronous and each call is one short transaction, safe to call from several
threads (calls are serialised). It knows nothing of cgroups, NVML or HTTP; its only API errors
are the ones a caller would answer with anyway (``InsufficientGpus``, and what the core's
transition table, ``seams.TRANSITIONS``, says for a state change it refuses).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

from ..._structs import GpuUuid, RequestId, Target, target_from_key
from ..core.errors import InsufficientGpus
from ..core.seams import (
    ContainerKey,
    GpuRecord,
    Reservation,
    ReservationState,
    Suspension,
    SuspensionState,
    Transition,
    plan_transition,
)

LEDGER_FILE = "ledger.sqlite3"
LOCK_FILE = "agent.lock"

Clock = Callable[[], datetime]
Migration = Callable[[sqlite3.Connection], None]
"""Brings the schema from version ``i`` to ``i + 1`` (its index in the list is ``i``).

Runs inside the opening transaction; it must use ``execute`` only (``executescript`` would
commit half-way)."""


class LedgerError(Exception):
    """The ledger cannot do its job: storage failure, a schema it does not know, closed."""


class LedgerLocked(LedgerError):
    """Another live process holds the state dir."""

    def __init__(self, lock_path: Path, holder_pid: int | None) -> None:
        holder = "an unknown process" if holder_pid is None else f"process {holder_pid}"
        super().__init__(
            f"the state dir {lock_path.parent} is in use by another agent ({holder} holds "
            f"{lock_path}); stop that agent or give this one another state dir"
        )
        self.lock_path = lock_path
        self.holder_pid = holder_pid


def _schema_v1(conn: sqlite3.Connection) -> None:
    # STRICT tables (SQLite >= 3.37) refuse values of the wrong type instead of storing them.
    conn.execute(
        """CREATE TABLE gpus (
            uuid TEXT PRIMARY KEY NOT NULL,
            idx INTEGER NOT NULL,
            minor INTEGER NOT NULL,
            name TEXT NOT NULL
        ) STRICT"""
    )
    conn.execute(
        """CREATE TABLE attachments (
            uuid TEXT PRIMARY KEY NOT NULL REFERENCES gpus (uuid),
            target_key TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('reserving', 'granted', 'releasing')),
            request_id TEXT,
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL,
            granted_at TEXT
        ) STRICT"""
    )
    conn.execute("CREATE INDEX attachments_by_target ON attachments (target_key, request_id)")


def _schema_v2(conn: sqlite3.Connection) -> None:
    # The owner of a grant is a container, not a pid: each row names the container it was
    # granted to. Rows of an older agent get '' ("not recorded"): the resolver then matches
    # the target's process alone, as that agent did.
    conn.execute("ALTER TABLE attachments ADD COLUMN container_key TEXT NOT NULL DEFAULT ''")


def _schema_v3(conn: sqlite3.Connection) -> None:
    # Whether the grant created the GPU's device node: only such a node is removed on release
    # (a node that was there before — put there by the runtime — is never the agent's to delete).
    conn.execute("ALTER TABLE attachments ADD COLUMN node_created INTEGER NOT NULL DEFAULT 0")


def _schema_v4(conn: sqlite3.Connection) -> None:
    # A target whose CUDA processes were checkpointed (issue 39): one row per target, written
    # before its first process is locked ('suspending') and moved to 'suspended' once its GPUs
    # are released, so a restarted agent can roll back or resume whatever a crash interrupted.
    conn.execute(
        """CREATE TABLE suspensions (
            target_key TEXT PRIMARY KEY NOT NULL,
            container_key TEXT NOT NULL,
            model TEXT NOT NULL,
            gpus TEXT NOT NULL,
            pids TEXT NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('suspending', 'suspended')),
            host_memory INTEGER,
            updated_at TEXT NOT NULL
        ) STRICT"""
    )


MIGRATIONS: Sequence[Migration] = (_schema_v1, _schema_v2, _schema_v3, _schema_v4)
"""The schema's history; append, never edit (a deployed ledger has run the old steps)."""

_ENTRY_SELECT = """
    SELECT g.uuid, g.idx, g.minor, g.name, a.target_key, a.container_key, a.state,
           a.request_id, a.created_at, a.granted_at, a.node_created
    FROM attachments AS a JOIN gpus AS g ON g.uuid = a.uuid
"""
_ENTRY_ORDER = " ORDER BY g.idx, g.uuid"


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _to_text(moment: datetime) -> str:
    if moment.tzinfo is None:
        raise ValueError("the ledger's clock must return timezone-aware datetimes")
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


def _entry(row: sqlite3.Row) -> Reservation:
    try:
        return _decode_entry(row)
    except ValueError as e:
        raise LedgerError(f"ledger row of {row['uuid']} is corrupt: {e}") from e


def _decode_entry(row: sqlite3.Row) -> Reservation:
    return Reservation(
        gpu=GpuRecord(GpuUuid(row["uuid"]), row["idx"], row["minor"], row["name"]),
        target=target_from_key(row["target_key"]),
        container=ContainerKey(row["container_key"]),
        state=ReservationState(row["state"]),
        request_id=None if row["request_id"] is None else RequestId(row["request_id"]),
        created_at=datetime.fromisoformat(row["created_at"]),
        granted_at=None if row["granted_at"] is None else datetime.fromisoformat(row["granted_at"]),
        node_created=bool(row["node_created"]),
    )


def _suspension(row: sqlite3.Row) -> Suspension:
    try:
        return Suspension(
            target=target_from_key(row["target_key"]),
            container=ContainerKey(row["container_key"]),
            model=row["model"],
            gpus=tuple(
                GpuRecord(GpuUuid(uuid), index, minor, name)
                for uuid, index, minor, name in json.loads(row["gpus"])
            ),
            pids=tuple(int(pid) for pid in json.loads(row["pids"])),
            state=SuspensionState(row["state"]),
            host_memory=row["host_memory"],
        )
    except (ValueError, TypeError) as e:
        raise LedgerError(f"ledger suspension of {row['target_key']} is corrupt: {e}") from e


def _acquire_lock(lock_path: Path) -> int:
    """Take the state dir's lock or say who has it; returns the fd that holds the lock."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        raise LedgerLocked(lock_path, int(holder) if holder.isdigit() else None) from e
    except OSError:
        os.close(fd)
        raise
    # Only for the message another agent shows; the lock itself is the flock. Fixed width and
    # overwritten in place, so a reader never sees the file emptied between two holders.
    record = f"{os.getpid():<15}\n".encode("ascii")
    os.pwrite(fd, record, 0)
    os.ftruncate(fd, len(record))
    return fd


def _connect(db_path: Path) -> sqlite3.Connection:
    # Create the file ourselves so it is 0600 whatever the umask; SQLite gives its -wal and
    # -shm files the database file's permissions.
    os.close(os.open(db_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    # isolation_level=None: no implicit transactions; every write uses BEGIN IMMEDIATE itself.
    conn = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False, timeout=5.0)
    try:
        conn.row_factory = sqlite3.Row
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal":
            raise LedgerError(f"{db_path}: SQLite refused WAL mode (got {mode!r})")
        # NORMAL, not FULL: see the module docstring for why this loses nothing that matters.
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")
    except BaseException:
        conn.close()
        raise
    return conn


def _migrate(conn: sqlite3.Connection, db_path: Path, migrations: Sequence[Migration]) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > len(migrations):
            raise LedgerError(
                f"{db_path} has schema version {version}, newer than this agent knows "
                f"({len(migrations)}); upgrade the agent or give it another state dir"
            )
        for migration in migrations[version:]:
            migration(conn)
        # PRAGMA takes no parameters; the value is an int we computed.
        conn.execute(f"PRAGMA user_version = {len(migrations)}")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _open_database(db_path: Path, migrations: Sequence[Migration]) -> sqlite3.Connection:
    """A configured, up-to-date connection, or ``LedgerError`` with nothing left open."""
    try:
        conn = _connect(db_path)
    except (sqlite3.Error, OSError) as e:
        raise LedgerError(f"cannot open the ledger {db_path}: {e}") from e
    try:
        _migrate(conn, db_path, migrations)
    except sqlite3.Error as e:
        conn.close()
        raise LedgerError(f"cannot open the ledger {db_path}: {e}") from e
    except BaseException:
        conn.close()
        raise
    return conn


class Ledger:
    """The open ledger of one state dir; create it with ``Ledger.open``.

    Usable as a context manager; ``close()`` releases the state dir for the next agent.
    """

    def __init__(
        self, conn: sqlite3.Connection, *, lock_fd: int, state_dir: Path, clock: Clock
    ) -> None:
        self._conn: sqlite3.Connection | None = conn
        self._lock_fd = lock_fd
        self._clock = clock
        self._mutex = threading.Lock()
        self.state_dir = state_dir
        self.db_path = state_dir / LEDGER_FILE

    @classmethod
    def open(
        cls,
        state_dir: Path,
        *,
        clock: Clock = _utcnow,
        migrations: Sequence[Migration] = MIGRATIONS,
    ) -> Ledger:
        """Lock ``state_dir`` (created 0700 if missing), open the ledger, upgrade its schema.

        Raises ``LedgerLocked`` when another agent holds the dir, ``LedgerError`` otherwise.
        ``clock`` and ``migrations`` are seams for tests (fake time, schema upgrades).
        """
        try:
            state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            lock_fd = _acquire_lock(state_dir / LOCK_FILE)
        except OSError as e:
            raise LedgerError(f"cannot lock the state dir {state_dir}: {e}") from e
        try:
            conn = _open_database(state_dir / LEDGER_FILE, migrations)
        except BaseException:
            os.close(lock_fd)
            raise
        return cls(conn, lock_fd=lock_fd, state_dir=state_dir, clock=clock)

    def close(self) -> None:
        """Close the database and drop the lock; further calls raise ``LedgerError``."""
        with self._mutex:
            if self._conn is None:
                return
            conn, self._conn = self._conn, None
            try:
                conn.close()
            finally:
                os.close(self._lock_fd)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- transactions ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _session(self, *, write: bool) -> Iterator[sqlite3.Connection]:
        """One serialised use of the connection; a write is one ``BEGIN IMMEDIATE`` transaction.

        sqlite3 errors leave as ``LedgerError``; our own API errors pass through unchanged
        after the rollback.
        """
        with self._mutex:
            conn = self._conn
            if conn is None:
                raise LedgerError(f"the ledger {self.db_path} is closed")
            try:
                if not write:
                    yield conn
                    return
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                except BaseException:
                    # SQLite may already have rolled back on its own (e.g. disk full).
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            except sqlite3.Error as e:
                raise LedgerError(f"ledger {self.db_path}: {e}") from e

    def _now(self) -> str:
        return _to_text(self._clock())

    @staticmethod
    def _entries(
        conn: sqlite3.Connection, where: str, params: Sequence[object]
    ) -> list[Reservation]:
        rows = conn.execute(_ENTRY_SELECT + where + _ENTRY_ORDER, params).fetchall()
        return [_entry(row) for row in rows]

    def _plan(
        self, conn: sqlite3.Connection, transition: Transition, wanted: Sequence[GpuUuid]
    ) -> dict[GpuUuid, ReservationState]:
        """Where ``transition`` takes each of ``wanted``, by the one table
        (``seams.TRANSITIONS``), or its error before anything is written."""
        found = {
            entry.gpu.uuid: entry for entry in self._entries(conn, _where_uuid_in(wanted), wanted)
        }
        return plan_transition(transition, wanted, found.get)

    def _move(
        self,
        conn: sqlite3.Connection,
        plan: dict[GpuUuid, ReservationState],
        *,
        nodes_created: Collection[GpuUuid] = (),
    ) -> None:
        """Write the planned states of the entries that change (``granted_at`` and
        ``node_created`` are set when an entry becomes ``granted`` for the first time)."""
        now = self._now()
        for uuid, state in plan.items():
            if state is ReservationState.GRANTED:
                conn.execute(
                    """UPDATE attachments SET state = 'granted', updated_at = ?,
                       granted_at = coalesce(granted_at, ?),
                       node_created = CASE WHEN state = 'reserving' THEN ? ELSE node_created END
                       WHERE uuid = ? AND state != 'granted'""",
                    (now, now, int(uuid in nodes_created), uuid),
                )
            else:
                conn.execute(
                    "UPDATE attachments SET state = ?, updated_at = ?"
                    " WHERE uuid = ? AND state != ?",
                    (state.value, now, uuid, state.value),
                )

    # --- changes ---------------------------------------------------------------------------------

    def reserve(
        self,
        target: Target,
        count: int,
        *,
        container: ContainerKey,
        candidates: Sequence[GpuRecord],
        request_id: RequestId | None = None,
    ) -> list[Reservation]:
        """Atomically take ``count`` free GPUs out of ``candidates`` for ``target``, whose
        container is ``container``.

        ``candidates`` are the GPUs that may be handed out now (the live inventory, in the
        order of preference); the ledger remembers their minor, index and name. New entries
        are ``reserving`` and record ``request_id`` (the service decides what a repeated one
        means). Raises ``InsufficientGpus`` when fewer than ``count`` are free.
        """
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        _check_distinct(candidates)
        key = target.key
        with self._session(write=True) as conn:
            conn.executemany(
                """INSERT INTO gpus (uuid, idx, minor, name) VALUES (?, ?, ?, ?)
                   ON CONFLICT (uuid) DO UPDATE
                   SET idx = excluded.idx, minor = excluded.minor, name = excluded.name""",
                [(gpu.uuid, gpu.index, gpu.minor, gpu.name) for gpu in candidates],
            )
            taken = {row[0] for row in conn.execute("SELECT uuid FROM attachments")}
            free = [gpu for gpu in candidates if gpu.uuid not in taken]
            if len(free) < count:
                raise InsufficientGpus(free=len(free), requested=count)
            now = self._now()
            conn.executemany(
                """INSERT INTO attachments
                   (uuid, target_key, container_key, state, request_id, created_at, updated_at)
                   VALUES (?, ?, ?, 'reserving', ?, ?, ?)""",
                [(gpu.uuid, key, container, request_id, now, now) for gpu in free[:count]],
            )
            chosen = [gpu.uuid for gpu in free[:count]]
            return self._entries(conn, _where_uuid_in(chosen), chosen)

    def intend_nodes(self, uuids: Collection[GpuUuid]) -> list[Reservation]:
        """Set ``node_created`` on those of ``uuids`` that are ``reserving``: the grant about
        to run will make their device nodes (recorded before the ``mknod``)."""
        wanted = sorted(set(uuids))
        with self._session(write=True) as conn:
            conn.execute(
                f"""UPDATE attachments SET node_created = 1, updated_at = ?
                    {_where_uuid_in(wanted, alias="")} AND state = 'reserving'""",
                (self._now(), *wanted),
            )
            return self._entries(conn, _where_uuid_in(wanted), wanted)

    def mark_granted(
        self, uuids: Collection[GpuUuid], *, nodes_created: Collection[GpuUuid] = ()
    ) -> list[Reservation]:
        """``Transition.MARK_GRANTED`` once the host grants the GPUs; ``nodes_created``: those
        whose device node the grant created. Refused as ``seams.TRANSITIONS`` says; then none
        changes."""
        return self._transition(Transition.MARK_GRANTED, uuids, nodes_created=nodes_created)

    def begin_release(self, uuids: Collection[GpuUuid]) -> list[Reservation]:
        """``Transition.BEGIN_RELEASE``: announce the release of ``granted`` GPUs."""
        return self._transition(Transition.BEGIN_RELEASE, uuids)

    def cancel_release(self, uuids: Collection[GpuUuid]) -> list[Reservation]:
        """``Transition.CANCEL_RELEASE``: the release did not happen (the GPU turned out to be
        in use, or the host refused) and the target still has the GPU."""
        return self._transition(Transition.CANCEL_RELEASE, uuids)

    def _transition(
        self,
        transition: Transition,
        uuids: Collection[GpuUuid],
        *,
        nodes_created: Collection[GpuUuid] = (),
    ) -> list[Reservation]:
        """One transition of several entries in one transaction: all of them or none."""
        wanted = sorted(set(uuids))
        with self._session(write=True) as conn:
            self._move(conn, self._plan(conn, transition, wanted), nodes_created=nodes_created)
            return self._entries(conn, _where_uuid_in(wanted), wanted)

    def rebind(
        self, uuids: Collection[GpuUuid], target: Target, container: ContainerKey
    ) -> list[Reservation]:
        """Give these attachments (any state) to ``target`` in ``container``: the container
        they were granted to lives on under another process. Unknown uuids are ignored."""
        wanted = sorted(set(uuids))
        with self._session(write=True) as conn:
            conn.execute(
                f"""UPDATE attachments SET target_key = ?, container_key = ?, updated_at = ?
                    {_where_uuid_in(wanted, alias="")}""",
                (target.key, container, self._now(), *wanted),
            )
            return self._entries(conn, _where_uuid_in(wanted), wanted)

    def release(self, uuids: Iterable[GpuUuid]) -> None:
        """Forget these attachments, in any state (also to roll back a reservation).

        Unknown uuids are ignored, so a release interrupted by a crash can simply be repeated.
        """
        with self._session(write=True) as conn:
            conn.executemany("DELETE FROM attachments WHERE uuid = ?", [(u,) for u in uuids])

    # --- queries ---------------------------------------------------------------------------------

    def get(self, uuid: GpuUuid) -> Reservation | None:
        """The attachment of one GPU, if it has one."""
        with self._session(write=False) as conn:
            entries = self._entries(conn, "WHERE a.uuid = ?", (uuid,))
        return entries[0] if entries else None

    def attachments(self, target: Target | None = None) -> list[Reservation]:
        """All attachments (any state), or those of one target; in GPU index order."""
        with self._session(write=False) as conn:
            if target is None:
                return self._entries(conn, "", ())
            return self._entries(conn, "WHERE a.target_key = ?", (target.key,))

    def pending(self) -> list[Reservation]:
        """Entries not ``granted``: what a crash left half-done, to finish or roll back."""
        with self._session(write=False) as conn:
            return self._entries(conn, "WHERE a.state != 'granted'", ())

    # --- suspensions (``seams.SuspensionBook``) ---------------------------------------------

    def record_suspension(self, suspension: Suspension) -> None:
        """Write the target's suspension, replacing its earlier one."""
        gpus = [[g.uuid, g.index, g.minor, g.name] for g in suspension.gpus]
        with self._session(write=True) as conn:
            conn.execute(
                "INSERT OR REPLACE INTO suspensions VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    suspension.target.key,
                    suspension.container,
                    suspension.model,
                    json.dumps(gpus),
                    json.dumps(list(suspension.pids)),
                    suspension.state.value,
                    suspension.host_memory,
                    self._now(),
                ),
            )

    def suspension(self, target: Target) -> Suspension | None:
        """The target's suspension, if it has one."""
        with self._session(write=False) as conn:
            row = conn.execute(
                "SELECT * FROM suspensions WHERE target_key = ?", (target.key,)
            ).fetchone()
        return None if row is None else _suspension(row)

    def suspensions(self) -> list[Suspension]:
        """Every suspension, in target order."""
        with self._session(write=False) as conn:
            rows = conn.execute("SELECT * FROM suspensions ORDER BY target_key").fetchall()
        return [_suspension(row) for row in rows]

    def forget_suspension(self, target: Target) -> None:
        """Drop the target's suspension (none: nothing to do)."""
        with self._session(write=True) as conn:
            conn.execute("DELETE FROM suspensions WHERE target_key = ?", (target.key,))


def _check_distinct(candidates: Sequence[GpuRecord]) -> None:
    if len({gpu.uuid for gpu in candidates}) != len(candidates):
        raise ValueError("candidates name the same GPU more than once")


def _where_uuid_in(uuids: Sequence[str], *, alias: str = "a.") -> str:
    """``WHERE <alias>uuid IN (?, ?, ...)`` with one placeholder per uuid."""
    return f" WHERE {alias}uuid IN ({', '.join('?' * len(uuids))})"
