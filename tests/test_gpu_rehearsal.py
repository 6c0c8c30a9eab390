"""The rehearsal of the real-GPU tier: ``run-on-device.sh --simulate`` as a GPU machine runs it.

A GPU machine is lent for 15 minutes, bare, with no network and a Python that has PyTorch,
``nvidia-ml-py``, ``psutil``, ``prometheus-client`` and ``pytest`` but no Jupyter, tornado or
traitlets (``docs/testing.md``, "Tier 5"). This test builds that situation here and runs the one
command in it: a fresh virtualenv holding only those packages (PyTorch aside: the simulated GPUs
have no CUDA), an empty environment (``env -i``), a network namespace with only loopback
(``unshare -n``), the wheelhouse ``tests/gpu/prepare.sh`` made — and every step must pass (MIG
aside: the rehearsal's GPUs are not in MIG mode). It also checks what the device tool can carry
and bring back: the checkout with the wheelhouse under 64 MiB, at most 8 files of at most 16 MiB
in ``$OUT``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Final

import pytest

from tests.fixtures.commands import run_checked
from tests.fixtures.requirements import needs_root

pytestmark = [*needs_root, pytest.mark.slow]

ROOT: Final = Path(__file__).resolve().parent.parent
DEVICE_PACKAGES: Final = ("nvidia-ml-py", "psutil", "prometheus-client", "pytest", "pytest-timeout")
"""What the GPU machines' Python has that the tier uses (``../shared/FIELD.md``)."""
CARRY_LIMIT: Final = 64 * 2**20
OUT_FILES: Final = 8
OUT_FILE_LIMIT: Final = 16 * 2**20
STEPS_EXPECTED: Final = {
    "1": "passed",
    "2": "passed",
    "3": "passed",
    "4": "passed",
    "5": "passed",
    "6": "passed",
    "6b": "skipped",
    "7": "passed",
    "8": "passed",
}


@pytest.fixture(scope="module")
def device_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv with only the GPU machine's packages (the versions of the test venv)."""
    venv = tmp_path_factory.mktemp("device-python")
    run_checked([sys.executable, "-m", "venv", "--clear", venv], timeout=120, what="the venv")
    python = venv / "bin" / "python"
    pins = [f"{name}=={version(name)}" for name in DEVICE_PACKAGES]
    run_checked(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *pins],
        timeout=300,
        what="the GPU machine's packages",
    )
    return python


@pytest.fixture(scope="module")
def wheelhouse() -> Path:
    run_checked(
        ["bash", ROOT / "tests/gpu/prepare.sh"], timeout=300, what="the wheelhouse", cwd=ROOT
    )
    return ROOT / "tests/gpu/wheelhouse"


def _carried_bytes(wheelhouse: Path) -> int:
    """The working tree the device tool takes along (tracked and untracked files that git does
    not ignore) plus the wheelhouse it is told to carry."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    paths = [ROOT / os.fsdecode(name) for name in listed if name]
    tree = sum(path.stat().st_size for path in paths if path.is_file())
    return tree + sum(path.stat().st_size for path in wheelhouse.iterdir())


def _verdicts(report: str) -> dict[str, str]:
    """Step number → the first word of its verdict, from the report's summary table."""
    lines = report.splitlines()
    start = lines.index("| step | verdict |") + 2
    found = {}
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        title, verdict = line.strip("| ").split(" | ", 1)
        found[title.split(".", 1)[0]] = verdict.split(":", 1)[0].split()[0]
    return found


def test_the_rehearsal_runs_every_step_offline_with_the_gpu_machines_python(
    device_python: Path, wheelhouse: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    home = tmp_path / "home"
    home.mkdir()
    environment = [
        f"PATH={device_python.parent}:/usr/sbin:/usr/bin:/sbin:/bin",
        f"HOME={home}",
        f"OUT={out}",
        f"GPU_PYTHON={device_python}",
    ]
    started = time.monotonic()
    done = subprocess.run(
        [
            "unshare",
            "--net",
            "--",
            "sh",
            "-c",
            'ip link set lo up && exec env -i "$@"',
            "sh",
            *environment,
            "bash",
            str(ROOT / "tests/gpu/run-on-device.sh"),
            "--simulate",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    seconds = time.monotonic() - started
    print(
        f"the rehearsal took {seconds:.1f} s; carried {_carried_bytes(wheelhouse) / 2**20:.1f} MiB"
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    report = (out / "real-gpu.md").read_text()
    assert "SIMULATED rehearsal" in report
    assert _verdicts(report) == STEPS_EXPECTED, report[:3000]
    files = sorted(out.iterdir())
    assert len(files) <= OUT_FILES, files
    assert all(f.is_file() and f.stat().st_size <= OUT_FILE_LIMIT for f in files), files
    assert {f.name for f in files} >= {"real-gpu.md", "agent.log", "run.log", "junit.xml"}
    assert _carried_bytes(wheelhouse) < CARRY_LIMIT
