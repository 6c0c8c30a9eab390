"""``kernel.cuda``: telling whether CUDA has started in this process, from evidence.

The pure parts run on fixture text and fake modules; the whole detector runs in child processes
that map stand-in ``libcuda.so.1`` libraries (see ``cuda_stand_in``), because a library mapped
into the test process could never be unmapped again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from jupyter_gpu_hotplug.kernel.cuda import (
    CudaState,
    DriverAnswer,
    DriverProbe,
    FrameworkFindings,
    advice,
    cuda_initialised,
    framework_evidence,
    judge,
    libcuda_paths,
    probe_driver,
)

from .cuda_stand_in import build_stand_in

REPO_ROOT = Path(__file__).resolve().parents[2]
DRIVER = "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"

MAPS = f"""\
55d0c4a00000-55d0c4a2c000 r--p 00000000 08:01 1835   /usr/bin/python3.11
7f1c2a000000-7f1c2a200000 rw-p 00000000 00:00 0
7f1c2b000000-7f1c2b400000 r--p 00000000 08:01 4242   {DRIVER}
7f1c2b400000-7f1c2c000000 r-xp 00400000 08:01 4242   {DRIVER}
7f1c2d000000-7f1c2d100000 r-xp 00000000 08:01 5151   /opt/conda/lib/libcudart.so.12.4.127
7f1c2e000000-7f1c2e100000 r-xp 00000000 08:01 5152   /opt/conda/lib/libcudnn.so.9
7ffd1c000000-7ffd1c021000 rw-p 00000000 00:00 0      [stack]
"""


# --- libcuda_paths ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(MAPS, (DRIVER,), id="driver-mapped-twice-counted-once"),
        pytest.param(
            "7f00-7f01 r-xp 00000000 08:01 9 /usr/lib64/libcuda.so.1\n",
            ("/usr/lib64/libcuda.so.1",),
            id="soname",
        ),
        pytest.param(
            "7f00-7f01 r-xp 00000000 08:01 9 /usr/local/cuda/lib64/stubs/libcuda.so\n",
            ("/usr/local/cuda/lib64/stubs/libcuda.so",),
            id="unversioned-stub",
        ),
        pytest.param(
            "7f00-7f01 r-xp 00000000 08:01 9 /tmp/my libs/libcuda.so.1 (deleted)\n",
            ("/tmp/my libs/libcuda.so.1",),
            id="space-in-path-and-deleted",
        ),
        pytest.param(
            "7f00-7f01 r-xp 00000000 08:01 9 /opt/lib/libcudart.so.12\n"
            "7f01-7f02 r-xp 00000000 08:01 9 /opt/lib/libcuda_wrapper.so\n"
            "7f02-7f03 r-xp 00000000 08:01 9 /opt/lib/libcuda.so.1.bak\n",
            (),
            id="look-alikes-are-not-the-driver",
        ),
        pytest.param("7f00-7f01 rw-p 00000000 00:00 0\n\n", (), id="anonymous-only"),
        pytest.param("", (), id="empty"),
    ],
)
def test_libcuda_paths(text: str, expected: tuple[str, ...]) -> None:
    assert libcuda_paths(text) == expected


# --- framework probes ---------------------------------------------------------------------


def _torch(initialised: bool) -> SimpleNamespace:
    return SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: initialised))


def _broken_torch() -> SimpleNamespace:
    def is_initialized() -> bool:
        raise RuntimeError("internals moved")

    return SimpleNamespace(cuda=SimpleNamespace(is_initialized=is_initialized))


@pytest.mark.parametrize(
    ("modules", "started", "notes"),
    [
        pytest.param({}, 0, 0, id="nothing-imported"),
        pytest.param({"torch": _torch(False)}, 0, 0, id="torch-imported-cuda-idle"),
        pytest.param({"torch": _torch(True)}, 1, 0, id="torch-initialised"),
        pytest.param(
            {
                "numba.cuda.cudadrv.driver": SimpleNamespace(
                    driver=SimpleNamespace(initialized=True)
                )
            },
            1,
            0,
            id="numba-initialised",
        ),
        pytest.param(
            {
                "numba.cuda.cudadrv.driver": SimpleNamespace(
                    driver=SimpleNamespace(initialized=False)
                )
            },
            0,
            0,
            id="numba-idle",
        ),
        pytest.param(
            {"jax._src.xla_bridge": SimpleNamespace(_backends={"cpu": object(), "cuda": object()})},
            1,
            0,
            id="jax-gpu-backend",
        ),
        pytest.param(
            {"jax._src.xla_bridge": SimpleNamespace(_backends={"cpu": object()})},
            0,
            0,
            id="jax-cpu-only",
        ),
        pytest.param({"torch": _broken_torch()}, 0, 1, id="probe-failure-is-a-note"),
        pytest.param({"torch": SimpleNamespace()}, 0, 0, id="torch-without-cuda-module"),
    ],
)
def test_framework_evidence(modules: dict[str, object], started: int, notes: int) -> None:
    findings = framework_evidence(modules)

    assert (len(findings.started), len(findings.notes)) == (started, notes)


def test_framework_evidence_names_the_framework() -> None:
    findings = framework_evidence({"torch": _torch(True)})

    assert findings.started == ("torch has initialised CUDA (torch.cuda.is_initialized() is True)",)


# --- judge --------------------------------------------------------------------------------

TORCH_STARTED = FrameworkFindings(started=("torch has initialised CUDA",))
NONE = FrameworkFindings()


def _probe(answer: DriverAnswer, code: int | None = None) -> DriverProbe:
    return DriverProbe(answer, DRIVER, code)


@pytest.mark.parametrize(
    ("libraries", "frameworks", "drivers", "initialised"),
    [
        pytest.param((), NONE, (), False, id="no-libcuda"),
        pytest.param((), TORCH_STARTED, (), False, id="no-libcuda-outweighs-a-framework"),
        pytest.param(None, TORCH_STARTED, (), True, id="maps-unreadable-framework-decides"),
        pytest.param(None, NONE, (), False, id="maps-unreadable-nothing-known"),
        pytest.param(
            (DRIVER,), NONE, (_probe(DriverAnswer.INITIALISED, 0),), True, id="driver-started"
        ),
        pytest.param(
            (DRIVER,), NONE, (_probe(DriverAnswer.NOT_INITIALISED, 3),), False, id="driver-idle"
        ),
        pytest.param(
            (DRIVER,), NONE, (_probe(DriverAnswer.FAILED, 100),), True, id="driver-init-failed"
        ),
        pytest.param((DRIVER,), NONE, (_probe(DriverAnswer.UNKNOWN),), True, id="cannot-ask"),
        pytest.param(
            (DRIVER,),
            TORCH_STARTED,
            (_probe(DriverAnswer.NOT_INITIALISED, 3),),
            True,
            id="framework-says-started",
        ),
    ],
)
def test_judge(
    libraries: tuple[str, ...] | None,
    frameworks: FrameworkFindings,
    drivers: tuple[DriverProbe, ...],
    initialised: bool,
) -> None:
    state = judge(libraries=libraries, frameworks=frameworks, imported=(), drivers=drivers)

    assert state.initialised is initialised


@pytest.mark.parametrize(
    ("libraries", "imported", "initialised"),
    [
        pytest.param((), ("torch",), False, id="no-libcuda-torch-imported"),
        pytest.param((DRIVER,), (), False, id="libcuda-idle-nothing-imported"),
        pytest.param((DRIVER,), ("torch",), True, id="torch-may-have-cached-a-failed-probe"),
        pytest.param((DRIVER,), ("cupy", "jax"), True, id="several-imported"),
    ],
)
def test_idle_driver_is_believed_only_without_cuda_frameworks(
    libraries: tuple[str, ...], imported: tuple[str, ...], initialised: bool
) -> None:
    drivers = tuple(_probe(DriverAnswer.NOT_INITIALISED, 3) for _ in libraries)

    state = judge(libraries=libraries, frameworks=NONE, imported=imported, drivers=drivers)

    assert state.initialised is initialised
    if initialised:
        assert state.evidence[-1].startswith(f"{', '.join(imported)} ")
        assert "may already have asked CUDA for its GPUs" in state.evidence[-1]


def test_judge_explains_itself() -> None:
    started = judge(
        libraries=(DRIVER,),
        frameworks=TORCH_STARTED,
        imported=("cupy",),
        drivers=(_probe(DriverAnswer.INITIALISED, 0),),
    )
    idle = judge(
        libraries=(DRIVER,),
        frameworks=NONE,
        imported=(),
        drivers=(_probe(DriverAnswer.NOT_INITIALISED, 3),),
    )
    failed = judge(
        libraries=(DRIVER,),
        frameworks=NONE,
        imported=(),
        drivers=(_probe(DriverAnswer.FAILED, 100),),
    )

    assert started.evidence == (
        "torch has initialised CUDA",
        f"the CUDA driver in this process has started ({DRIVER} is loaded)",
        "cupy is imported",
    )
    assert idle.evidence == (f"{DRIVER} is loaded, but CUDA has not started in this process yet",)
    assert "CUDA error 100" in failed.evidence[0]


def test_cuda_initialised_reads_the_maps_file(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    asked: list[str] = []

    def driver(path: str) -> DriverProbe:
        asked.append(path)
        return DriverProbe(DriverAnswer.INITIALISED, path, 0)

    state = cuda_initialised(modules={"tensorflow": object()}, maps_path=maps, driver_probe=driver)

    assert asked == [DRIVER]
    assert state.initialised
    assert state.evidence[-1] == "tensorflow is imported"


def test_cuda_initialised_without_procfs_asks_the_frameworks(tmp_path: Path) -> None:
    state = cuda_initialised(modules={"torch": _torch(True)}, maps_path=tmp_path / "absent")

    assert state.initialised


# --- advice -------------------------------------------------------------------------------


def test_advice_when_cuda_is_idle_says_ready() -> None:
    text = advice(CudaState(initialised=False, evidence=()), attached=1)

    assert text.startswith("GPU ready")


def test_advice_when_cuda_started_says_what_to_do() -> None:
    text = advice(CudaState(initialised=True, evidence=("torch has initialised CUDA",)), attached=2)

    assert "CUDA is already initialised in this kernel (torch has initialised CUDA)" in text
    assert "THIS kernel will not see the new GPUs" in text
    assert "!python train.py" in text
    assert "restart the kernel (this releases the attached GPUs)" in text
    assert "BEFORE importing torch" in text


# --- the real detector in child processes -------------------------------------------------

_CHILD = """
import ctypes, json, sys, types
from dataclasses import asdict
from jupyter_gpu_hotplug.kernel.cuda import cuda_initialised, probe_driver
for name in filter(None, sys.argv[2].split(",")):
    sys.modules[name] = types.ModuleType(name)  # imported, with no CUDA state to read
for path in sys.argv[3:]:
    ctypes.CDLL(path)
result = {"state": asdict(cuda_initialised())}
if sys.argv[1] != "-":
    result["probe_unloaded"] = probe_driver(sys.argv[1]).answer.value
    result["mapped_after_probe"] = sys.argv[1] in open("/proc/self/maps").read()
print(json.dumps(result))
"""


def _child(
    *load: Path, probe_unloaded: Path | None = None, modules: tuple[str, ...] = ()
) -> dict[str, object]:
    argv = [
        sys.executable,
        "-c",
        _CHILD,
        str(probe_unloaded or "-"),
        ",".join(modules),
        *map(str, load),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stand-in-cuda")
    return {
        "empty": build_stand_in(root / "empty"),
        "idle": build_stand_in(root / "idle", result=3),
        "started": build_stand_in(root / "started", result=0),
        "failed": build_stand_in(root / "failed", result=100),
    }


def test_a_plain_python_has_no_cuda() -> None:
    result = _child()

    assert result["state"] == {"initialised": False, "evidence": []}


@pytest.mark.parametrize(
    ("kind", "initialised", "says"),
    [
        ("empty", True, "cannot say whether CUDA has started; assuming it has"),
        ("idle", False, "is loaded, but CUDA has not started in this process yet"),
        ("started", True, "the CUDA driver in this process has started"),
        ("failed", True, "CUDA error 100"),
    ],
)
def test_mapped_stand_in(
    stand_ins: dict[str, Path], kind: str, initialised: bool, says: str
) -> None:
    result = _child(stand_ins[kind])

    state = result["state"]
    assert isinstance(state, dict)
    assert state["initialised"] is initialised
    assert any(says in sentence for sentence in state["evidence"])
    assert str(stand_ins[kind]) in " ".join(state["evidence"])


def test_idle_driver_with_a_cuda_framework_imported_still_warns(
    stand_ins: dict[str, Path],
) -> None:
    result = _child(stand_ins["idle"], modules=("torch",))

    state = result["state"]
    assert isinstance(state, dict)
    assert state["initialised"] is True
    assert "torch is imported and may already have asked CUDA" in state["evidence"][-1]


def test_probing_never_loads_the_driver(stand_ins: dict[str, Path]) -> None:
    result = _child(probe_unloaded=stand_ins["started"])

    assert result["probe_unloaded"] == "unknown"
    assert result["mapped_after_probe"] is False
    assert probe_driver("/nonexistent/libcuda.so.1").answer is DriverAnswer.UNKNOWN
