"""Has CUDA already started in this process? The question every hot-attach must answer.

Boundary: looks at this process only — ``sys.modules`` (never importing anything new), the
libraries mapped in ``/proc/self/maps`` and, when ``libcuda`` is mapped, one harmless question
to the CUDA driver. It knows nothing of the agent, of NVML or of IPython.

Why it exists: the CUDA driver enumerates GPUs once, in ``cuInit``, and a process keeps that
list for its lifetime (DESIGN §5). A GPU hot-attached to a kernel whose CUDA is already up
stays invisible to that kernel; only new processes see it. The ``%gpu`` magic and the monitor
widget must therefore tell the user *before* they wonder why ``torch.cuda.device_count()``
still says 0.

How it decides, from strongest to weakest evidence:

1. ``libcuda`` is the only way into the CUDA driver, so if it is not mapped, CUDA cannot have
   started (whatever frameworks are imported: they load it lazily, or at import without
   starting it).
2. If it is mapped, the driver is asked with ``cuDeviceGetCount``, which has no side effects:
   the CUDA driver API documents that every call but ``cuInit`` returns
   ``CUDA_ERROR_NOT_INITIALIZED`` before ``cuInit``; it succeeds after a successful one; any
   other answer means ``cuInit`` ran and failed (no GPU at the time) — a process to replace
   as well.
3. "Not initialised" from the driver is believed only when no CUDA framework is imported.
   Frameworks cache what CUDA told them (PyTorch keeps its device count for the process once
   ``torch.cuda.is_available()`` asked, even when that ``cuInit`` failed), and whether the
   driver still answers "not initialised" after a failed ``cuInit`` is not documented. With
   libcuda loaded and torch, jax, tensorflow, cupy or numba imported, the advice is given.
4. A library that cannot answer (a stub, or the tests' stand-in without symbols) counts as
   initialised: warning needlessly costs a sentence, staying silent costs the user an hour.

Framework probes (``torch.cuda.is_initialized()`` and friends, only for modules already
imported, and only reads that cannot themselves initialise CUDA) add names to the evidence so
the message can say *which* library did it.
"""

from __future__ import annotations

import ctypes
import enum
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "CUDA_FRAMEWORKS",
    "CudaState",
    "DriverAnswer",
    "DriverProbe",
    "FrameworkFindings",
    "advice",
    "cuda_initialised",
    "framework_evidence",
    "judge",
    "libcuda_paths",
    "probe_driver",
]

SELF_MAPS: Final = Path("/proc/self/maps")

_LIBCUDA: Final = re.compile(r"libcuda\.so(?:\.[0-9]+)*")
_DELETED_SUFFIX: Final = " (deleted)"
_CUDA_SUCCESS: Final = 0
_CUDA_ERROR_NOT_INITIALIZED: Final = 3


@dataclass(frozen=True)
class CudaState:
    """Whether CUDA is (or must be assumed) initialised here, and what says so."""

    initialised: bool
    evidence: tuple[str, ...]
    """Sentences for people, strongest first; also filled when ``initialised`` is false
    (e.g. "libcuda is loaded, but CUDA has not started yet")."""


class DriverAnswer(enum.Enum):
    """What the CUDA driver mapped in this process says about ``cuInit``."""

    INITIALISED = "initialised"
    NOT_INITIALISED = "not_initialised"
    FAILED = "failed"
    """``cuInit`` ran and failed; the driver keeps that result for this process."""
    UNKNOWN = "unknown"
    """The library cannot be asked (no ``cuDeviceGetCount``: a stub or a stand-in)."""


@dataclass(frozen=True)
class DriverProbe:
    answer: DriverAnswer
    path: str
    code: int | None = None
    """The ``CUresult`` returned, when the library answered."""


def libcuda_paths(maps_text: str) -> tuple[str, ...]:
    """The distinct ``libcuda.so*`` files mapped, in order of appearance, from maps text.

    Each maps line is ``address perms offset dev inode [pathname]``; the pathname may contain
    spaces and ends in `` (deleted)`` when the file was replaced after it was mapped.
    ``libcudart``, ``libcudnn`` and friends do not count: only the driver enumerates GPUs.
    """
    found: dict[str, None] = {}
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].removesuffix(_DELETED_SUFFIX)
        if _LIBCUDA.fullmatch(os.path.basename(path)):
            found.setdefault(path, None)
    return tuple(found)


def probe_driver(path: str) -> DriverProbe:
    """Ask the already-mapped driver at ``path`` whether ``cuInit`` has run, without running it.

    ``RTLD_NOLOAD`` returns the copy already in the process and never loads a new one, so this
    cannot be what first brings CUDA into the kernel.
    """
    try:
        library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        count_devices = library.cuDeviceGetCount
    except (OSError, AttributeError):
        # Unmapped meanwhile, or a library without the driver API: it cannot tell us.
        return DriverProbe(DriverAnswer.UNKNOWN, path)
    count_devices.restype = ctypes.c_int
    count_devices.argtypes = [ctypes.POINTER(ctypes.c_int)]
    count = ctypes.c_int(0)
    code = int(count_devices(ctypes.byref(count)))
    if code == _CUDA_SUCCESS:
        return DriverProbe(DriverAnswer.INITIALISED, path, code)
    if code == _CUDA_ERROR_NOT_INITIALIZED:
        return DriverProbe(DriverAnswer.NOT_INITIALISED, path, code)
    return DriverProbe(DriverAnswer.FAILED, path, code)


def _torch(module: object) -> str | None:
    cuda = getattr(module, "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    if callable(is_initialized) and is_initialized():
        return "torch has initialised CUDA (torch.cuda.is_initialized() is True)"
    return None


def _numba_driver(module: object) -> str | None:
    driver = getattr(module, "driver", None)
    if getattr(driver, "initialized", False) is True:
        return "numba has initialised the CUDA driver"
    return None


def _jax_bridge(module: object) -> str | None:
    backends = getattr(module, "_backends", None)
    if isinstance(backends, Mapping) and any(name in backends for name in ("cuda", "gpu")):
        return "jax has started its GPU backend"
    return None


_FRAMEWORK_PROBES: Final[Mapping[str, Callable[[object], str | None]]] = {
    "torch": _torch,
    "numba.cuda.cudadrv.driver": _numba_driver,
    "jax._src.xla_bridge": _jax_bridge,
}
"""Module name → a check that reads state without initialising anything. Each looks only at
modules already imported by the user's code."""

CUDA_FRAMEWORKS: Final = ("torch", "jax", "tensorflow", "cupy", "numba")
"""Top-level modules that talk to CUDA and may cache its answers (see rule 3 above)."""


@dataclass(frozen=True)
class FrameworkFindings:
    """What imported frameworks say: ``started`` sentences decide, ``notes`` only inform."""

    started: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def framework_evidence(modules: Mapping[str, object]) -> FrameworkFindings:
    """Ask each imported framework (see ``_FRAMEWORK_PROBES``) whether it started CUDA."""
    started = []
    notes = []
    for name, probe in _FRAMEWORK_PROBES.items():
        module = modules.get(name)
        if module is None:
            continue
        try:
            sentence = probe(module)
        except Exception as error:
            # The framework's internals changed under us: the driver probe still decides.
            notes.append(f"{name} is imported, but asking it about CUDA failed ({error!r})")
            continue
        if sentence is not None:
            started.append(sentence)
    return FrameworkFindings(started=tuple(started), notes=tuple(notes))


def _driver_sentence(probe: DriverProbe) -> str:
    if probe.answer is DriverAnswer.INITIALISED:
        return f"the CUDA driver in this process has started ({probe.path} is loaded)"
    if probe.answer is DriverAnswer.FAILED:
        return (
            f"CUDA was started in this process and failed (CUDA error {probe.code}, e.g. no "
            f"GPU at the time); the driver ({probe.path}) keeps that answer for this process"
        )
    if probe.answer is DriverAnswer.NOT_INITIALISED:
        return f"{probe.path} is loaded, but CUDA has not started in this process yet"
    return f"{probe.path} is loaded and cannot say whether CUDA has started; assuming it has"


def judge(
    *,
    libraries: tuple[str, ...] | None,
    frameworks: FrameworkFindings,
    imported: tuple[str, ...],
    drivers: tuple[DriverProbe, ...],
) -> CudaState:
    """Combine the findings (pure); see the module docstring for the rules.

    ``libraries`` is ``None`` when the mapped libraries could not be read (not Linux): the
    frameworks alone decide then. ``imported``: the ``CUDA_FRAMEWORKS`` imported.
    """
    if not libraries:
        # With libcuda known to be absent nothing can have run cuInit; a framework saying
        # otherwise is believed only when the maps could not be read at all.
        started = frameworks.started if libraries is None else ()
        return CudaState(initialised=bool(started), evidence=(*started, *frameworks.notes))
    driver_started = any(probe.answer is not DriverAnswer.NOT_INITIALISED for probe in drivers)
    evidence = [
        *frameworks.started,
        *(_driver_sentence(probe) for probe in drivers),
        *frameworks.notes,
    ]
    if driver_started or frameworks.started:
        evidence.extend(f"{name} is imported" for name in imported)
        return CudaState(initialised=True, evidence=tuple(evidence))
    if imported:
        names = ", ".join(imported)
        evidence.append(
            f"{names} {'is' if len(imported) == 1 else 'are'} imported and may already have "
            "asked CUDA for its GPUs, keeping that answer for this process"
        )
        return CudaState(initialised=True, evidence=tuple(evidence))
    return CudaState(initialised=False, evidence=tuple(evidence))


def cuda_initialised(
    *,
    modules: Mapping[str, object] | None = None,
    maps_path: Path = SELF_MAPS,
    driver_probe: Callable[[str], DriverProbe] = probe_driver,
) -> CudaState:
    """This process's CUDA state. Cheap (one read of the maps file); never imports anything."""
    loaded = sys.modules if modules is None else modules
    try:
        maps_text: str | None = maps_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        maps_text = None  # Not Linux, or no procfs: the frameworks decide.
    libraries = None if maps_text is None else libcuda_paths(maps_text)
    return judge(
        libraries=libraries,
        frameworks=framework_evidence(loaded),
        imported=tuple(name for name in CUDA_FRAMEWORKS if name in loaded),
        drivers=tuple(driver_probe(path) for path in libraries or ()),
    )


def advice(state: CudaState, *, attached: int) -> str:
    """What to tell the user after attaching ``attached`` GPUs, given ``state``."""
    gpus = "GPU" if attached == 1 else "GPUs"
    if not state.initialised:
        return f"GPU ready: CUDA has not started in this kernel, so it will see the new {gpus}."
    why = "; ".join(state.evidence)
    return (
        f"CUDA is already initialised in this kernel ({why}).\n"
        f"A process keeps the GPU list it saw when CUDA started, so THIS kernel will not see "
        f"the new {gpus}. What to do:\n"
        f"  - run the GPU work in a new process, which sees the {gpus} now, "
        "e.g. `!python train.py`; or\n"
        f"  - restart the kernel (this releases the attached {gpus}), then run `%gpu attach` "
        "BEFORE importing torch / cupy / jax / tensorflow."
    )
