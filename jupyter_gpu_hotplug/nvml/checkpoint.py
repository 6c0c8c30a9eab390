"""The CUDA driver's process checkpoint API (``cuCheckpointProcess*``), called from the agent.

Why: a kernel that has used a GPU holds a CUDA context, so a detach is refused as busy and the
only ways out end the kernel. The driver (display driver 550 and later) can lock another
process's CUDA calls, move its GPU memory into host memory and release its GPU handles
(checkpoint), and later bring it back (restore; with GPU UUID pairs onto another GPU of the same
chip type) and let it run on (unlock). This module is the agent's typed binding of those calls,
nothing more: which processes to suspend, and what to do when one step fails, is the caller's.

Boundary: ``ctypes`` over ``libcuda.so.1`` (the real driver's, or the simulator's
``nvml/sim/fakecuda.c``, which implements the same calls for tests). Every failure is one
exception type, :class:`CheckpointError`, carrying the driver's error name. The layouts of the
argument structs follow NVIDIA's CUDA Driver API reference (``CUcheckpointLockArgs``,
``CUcheckpointRestoreArgs``, ``CUcheckpointGpuPair``: 64-byte argument blocks whose reserved
bytes must be zero).
"""

from __future__ import annotations

import ctypes
import enum
import uuid
from collections.abc import Mapping
from typing import Final

__all__ = ["DRIVER_LIBRARY", "CheckpointError", "CudaCheckpoint", "ProcessState"]

DRIVER_LIBRARY: Final = "libcuda.so.1"
"""What the real driver installs and the simulated driver root provides."""

_ENTRY_POINTS: Final = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessGetRestoreThreadId",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)
_MISSING: Final = "the driver lacks the CUDA checkpoint API (R550+)"
_ARGS_BYTES: Final = 64
_GPU_PREFIX: Final = "GPU-"


class ProcessState(enum.IntEnum):
    """``CUprocessState``: where a process is in the lock/checkpoint/restore cycle."""

    RUNNING = 0
    LOCKED = 1
    """Its CUDA calls block; its GPU memory is still on the GPU."""
    CHECKPOINTED = 2
    """Its GPU memory is in host memory and it holds no GPU handle."""
    FAILED = 3
    """An uncorrectable error during checkpoint or restore."""


class CheckpointError(Exception):
    """A checkpoint call failed: ``name`` is the driver's ``CUresult`` name (``code`` its
    number), or ``"UNSUPPORTED_DRIVER"`` with no code when the driver lacks the calls."""

    def __init__(self, call: str, name: str, code: int | None, detail: str = "") -> None:
        self.call = call
        self.name = name
        self.code = code
        super().__init__(f"{call}: {name}" + (f" ({detail})" if detail else ""))


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", _Uuid), ("newUuid", _Uuid)]


class _LockArgs(ctypes.Structure):
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class _RestoreArgs(ctypes.Structure):
    _fields_ = [
        ("gpuPairs", ctypes.POINTER(_GpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        (
            "reserved",
            ctypes.c_char
            * (_ARGS_BYTES - ctypes.sizeof(ctypes.c_void_p) - ctypes.sizeof(ctypes.c_uint)),
        ),
    ]


class _ZeroArgs(ctypes.Structure):
    """``CUcheckpointCheckpointArgs`` and ``CUcheckpointUnlockArgs``: all reserved."""

    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


def _uuid_bytes(gpu_uuid: str) -> _Uuid:
    """NVML's ``GPU-<uuid>`` as the driver's 16-byte ``CUuuid``."""
    if not gpu_uuid.startswith(_GPU_PREFIX):
        raise ValueError(f"not a GPU UUID (GPU-...): {gpu_uuid!r}")
    raw = uuid.UUID(gpu_uuid.removeprefix(_GPU_PREFIX)).bytes
    return _Uuid((ctypes.c_ubyte * 16)(*raw))


class CudaCheckpoint:
    """The checkpoint calls of one loaded CUDA driver library.

    Loading never fails on an older driver: ``supported()`` says whether the calls are there,
    and each call raises :class:`CheckpointError` naming the missing API when they are not.
    """

    def __init__(self, library: str = DRIVER_LIBRARY) -> None:
        try:
            self._cuda = ctypes.CDLL(library)
        except OSError as error:
            raise CheckpointError("load", "NO_DRIVER", None, f"{library}: {error}") from error

    def supported(self) -> bool:
        """Whether the driver exports every checkpoint call (R550 and later do)."""
        return all(hasattr(self._cuda, name) for name in _ENTRY_POINTS)

    def state(self, pid: int) -> ProcessState:
        """The CUDA checkpoint state of process ``pid``."""
        value = ctypes.c_int(-1)
        self._call("cuCheckpointProcessGetState", pid, ctypes.byref(value))
        return ProcessState(value.value)

    def restore_thread_id(self, pid: int) -> int:
        """The thread of ``pid`` that a restore runs on (CRIU must restore it with that id)."""
        tid = ctypes.c_int(-1)
        self._call("cuCheckpointProcessGetRestoreThreadId", pid, ctypes.byref(tid))
        return tid.value

    def lock(self, pid: int, timeout_ms: int) -> None:
        """RUNNING → LOCKED: block ``pid``'s CUDA calls once its work in flight drains.

        ``timeout_ms`` bounds the wait (0 is none, which an agent should never pass); on a
        timeout the process is left RUNNING and ``CUDA_ERROR_TIMEOUT`` is raised.
        """
        if not 0 <= timeout_ms < 2**32:
            raise ValueError(f"timeout_ms out of range: {timeout_ms}")
        args = _LockArgs(timeoutMs=timeout_ms)
        self._call("cuCheckpointProcessLock", pid, ctypes.byref(args))

    def checkpoint(self, pid: int) -> None:
        """LOCKED → CHECKPOINTED: GPU memory to host memory, GPU handles released."""
        self._call("cuCheckpointProcessCheckpoint", pid, ctypes.byref(_ZeroArgs()))

    def restore(self, pid: int, pairs: Mapping[str, str] | None = None) -> None:
        """CHECKPOINTED → LOCKED: back onto its GPUs, or with ``pairs`` (old GPU UUID → new
        GPU UUID, each ``GPU-...``; every checkpointed GPU named) onto others of the same chip
        type. The process stays LOCKED until :meth:`unlock`."""
        args = _RestoreArgs()
        if pairs:
            array = (_GpuPair * len(pairs))(
                *(_GpuPair(_uuid_bytes(old), _uuid_bytes(new)) for old, new in pairs.items())
            )
            args.gpuPairs = ctypes.cast(array, ctypes.POINTER(_GpuPair))
            args.gpuPairsCount = len(pairs)
        self._call("cuCheckpointProcessRestore", pid, ctypes.byref(args))

    def unlock(self, pid: int) -> None:
        """LOCKED → RUNNING: ``pid``'s CUDA calls proceed again."""
        self._call("cuCheckpointProcessUnlock", pid, ctypes.byref(_ZeroArgs()))

    def device_memory(self, pid: int) -> int | None:
        """Bytes of device memory ``pid`` uses, which a checkpoint moves to host memory: only
        the simulator answers (its ``fakeCudaProcessMemory``); the real driver has no such
        call, so None (NVML's per-process memory is the real source)."""
        lookup = getattr(self._cuda, "fakeCudaProcessMemory", None)
        used = ctypes.c_ulonglong()
        if lookup is None or lookup(ctypes.c_int(pid), ctypes.byref(used)) != 0:
            return None
        return used.value

    def _call(self, name: str, pid: int, argument: object) -> None:
        function = getattr(self._cuda, name, None)
        if function is None:
            raise CheckpointError(name, "UNSUPPORTED_DRIVER", None, _MISSING)
        code = int(function(ctypes.c_int(pid), argument))
        if code != 0:
            raise CheckpointError(name, self._error_name(code), code, f"process {pid}")

    def _error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        lookup = getattr(self._cuda, "cuGetErrorName", None)
        if lookup is not None and lookup(code, ctypes.byref(text)) == 0 and text.value:
            return text.value.decode()
        return f"CUresult {code}"
