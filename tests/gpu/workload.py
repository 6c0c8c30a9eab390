"""What runs *inside* the sandbox in the real-GPU tier: one task per process, its answer as JSON.

``python workload.py TASK RESULT [ARG...]`` — started by the sandbox's probe (whose stdout is its
protocol, so nothing here may print there): the answer goes to ``RESULT`` (written whole, then
renamed, so the test never reads half of it). Tasks:

``command ARGV...``
    run a program (``nvidia-smi -L``) and keep its exit status, output and wall time;
``cuda``
    what PyTorch sees in a new process: import and ``cuInit`` times, ``is_available()``, the
    devices with their UUIDs;
``matmul``
    a real computation on ``cuda:0`` checked against the CPU;
``hold SECONDS``
    keep a CUDA context with memory on ``cuda:0`` open (what a training kernel does), say so,
    then sleep — the busy GPU a detach must refuse; on simulated GPUs, hold the device nodes as
    the simulation's load helper does (no CUDA there);
``before-attach GO CALL``
    import PyTorch (and, with ``CALL`` = ``call``, ask ``is_available()``) *before* the attach,
    answer, wait for the file ``GO``, then ask again and ask this product's own "is CUDA already
    initialised here?" (``jupyter_gpu_hotplug.kernel.cuda``) — the hint ``%gpu attach`` gives;
``sample SECONDS INTERVAL``
    read every GPU through ``nvml.state.GpuMonitor`` at the live stream's interval and report the
    CPU time it took.

No PyTorch (the simulated rehearsal): the CUDA tasks answer ``{"torch": null}`` and the test
says the step's CUDA half did not run.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TORCH_MISSING: dict[str, Any] = {"torch": None}


def _write(path: Path, answer: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(answer))
    partial.rename(path)


def _import_torch() -> tuple[Any, float] | None:
    started = time.perf_counter()
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return torch, time.perf_counter() - started


def command(argv: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    except FileNotFoundError as e:
        return {"rc": None, "stdout": "", "stderr": str(e), "seconds": 0.0}
    return {
        "rc": done.returncode,
        "stdout": done.stdout,
        "stderr": done.stderr,
        "seconds": time.perf_counter() - started,
    }


def _devices(torch: Any) -> list[dict[str, Any]]:
    found = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        uuid = str(getattr(properties, "uuid", ""))
        found.append(
            {
                "index": index,
                "name": properties.name,
                "uuid": uuid if uuid.startswith("GPU-") or not uuid else f"GPU-{uuid}",
                "memory": int(properties.total_memory),
            }
        )
    return found


def _with_torch(task: Callable[[Any, float], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """``task(torch, import_seconds)``, or ``TORCH_MISSING`` where PyTorch is not installed."""

    def run() -> dict[str, Any]:
        imported = _import_torch()
        return TORCH_MISSING if imported is None else task(*imported)

    return run


@_with_torch
def cuda(torch: Any, import_seconds: float) -> dict[str, Any]:
    started = time.perf_counter()
    available = bool(torch.cuda.is_available())
    init_seconds = time.perf_counter() - started
    answer: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_version": torch.version.cuda,
        "import_seconds": import_seconds,
        "is_available": available,
        "is_available_seconds": init_seconds,
        "devices": [],
    }
    if available:
        answer["devices"] = _devices(torch)
        started = time.perf_counter()
        torch.zeros(1, device="cuda:0")
        torch.cuda.synchronize()
        answer["first_tensor_seconds"] = time.perf_counter() - started
    return answer


@_with_torch
def matmul(torch: Any, _import_seconds: float) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1234)
    a = torch.randn(2048, 2048, generator=generator, dtype=torch.float64)
    b = torch.randn(2048, 2048, generator=generator, dtype=torch.float64)
    expected = a @ b
    started = time.perf_counter()
    product = (a.to("cuda:0") @ b.to("cuda:0")).cpu()
    seconds = time.perf_counter() - started
    error = float((product - expected).abs().max())
    return {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "shape": [2048, 2048],
        "dtype": "float64",
        "max_abs_error": error,
        "seconds": seconds,
    }


def hold(result: Path, seconds: float) -> dict[str, Any]:
    imported = _import_torch()
    if imported is None:
        # Simulated GPUs: hold the nodes as the simulation's load helper does (O_PATH).
        held = [
            os.open(f"/dev/{name}", os.O_PATH)
            for name in sorted(os.listdir("/dev"))
            if name.startswith("nvidia") and name[len("nvidia") :].isdigit()
        ]
        _write(result, {"torch": None, "pid": os.getpid(), "held_fds": len(held)})
    else:
        torch, _ = imported
        block = torch.ones(64 * 1024 * 1024, device="cuda:0")  # 256 MiB of float32
        torch.cuda.synchronize()
        _write(result, {"torch": torch.__version__, "pid": os.getpid(), "bytes": block.nbytes})
    time.sleep(seconds)
    return {"ended": "slept out"}


def before_attach(result: Path, go: Path, call: bool) -> dict[str, Any]:
    imported = _import_torch()
    first: dict[str, Any] = {"pid": os.getpid(), "called_before": call}
    if imported is not None:
        torch, _ = imported
        first["torch"] = torch.__version__
        if call:
            first["is_available_before"] = bool(torch.cuda.is_available())
    else:
        first["torch"] = None
    _write(result.with_name(result.name + ".before"), first)
    deadline = time.monotonic() + 300
    while not go.exists():
        if time.monotonic() > deadline:
            return {**first, "error": "no go file within 300 s"}
        time.sleep(0.05)
    from jupyter_gpu_hotplug.kernel.cuda import advice, cuda_initialised

    state = cuda_initialised()
    after: dict[str, Any] = {
        **first,
        "hint_initialised": state.initialised,
        "hint_evidence": list(state.evidence),
        "hint_advice": advice(state, attached=1),
    }
    if imported is not None:
        torch, _ = imported
        after["is_available_after"] = bool(torch.cuda.is_available())
        after["device_count_after"] = int(torch.cuda.device_count())
    return after


def sample(seconds: float, interval: float) -> dict[str, Any]:
    from jupyter_gpu_hotplug.nvml.state import GpuMonitor

    reads = 0
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    deadline = time.monotonic() + seconds
    with GpuMonitor() as monitor:
        gpus = len(monitor.snapshot().gpus)
        while time.monotonic() < deadline:
            monitor.snapshot()
            reads += 1
            time.sleep(interval)
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    return {"gpus": gpus, "reads": reads, "seconds": seconds, "cpu_seconds": cpu}


def main(argv: list[str]) -> int:
    task, result, *args = argv
    path = Path(result)
    tasks: dict[str, Callable[[], dict[str, Any]]] = {
        "command": lambda: command(args),
        "cuda": cuda,
        "matmul": matmul,
        "hold": lambda: hold(path, float(args[0])),
        "before-attach": lambda: before_attach(path, Path(args[0]), args[1] == "call"),
        "sample": lambda: sample(float(args[0]), float(args[1])),
    }
    try:
        answer = tasks[task]()
    except Exception as e:  # The answer is the report: every failure goes into it.
        answer = {"error": f"{type(e).__name__}: {e}"}
    _write(path, answer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
