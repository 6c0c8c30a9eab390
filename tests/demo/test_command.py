"""``jupyter gpu-hotplug demo`` on the command line: its options; refusals that start nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_gpu_hotplug import cli
from jupyter_gpu_hotplug.demo.command import options_from_args
from jupyter_gpu_hotplug.demo.options import DemoOptions

from ..fixtures.requirements import needs_root
from . import leftovers
from .demo_process import JUPYTER

NOBODY = 65534

# Runs the real command line with the effective uid of "nobody". Everything the command needs
# is imported first: this interpreter may live where nobody cannot read (/root/.pyenv).
_AS_NOBODY = f"""
import os, sys
from jupyter_gpu_hotplug import cli
from jupyter_gpu_hotplug.demo import errors, runner
os.setegid({NOBODY})
os.seteuid({NOBODY})
sys.exit(cli.main(sys.argv[1:]))
"""


def parse(*argv: str) -> DemoOptions:
    args = cli.build_parser().parse_args(["demo", *argv])
    return options_from_args(args)


def test_demo_is_listed_by_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert cli.main(["demo", "--help"]) == 0
    help_text = capsys.readouterr().out
    for option in ("--simulate", "--port", "--ip", "--no-browser", "--state-dir", "--notebook-dir"):
        assert option in help_text
    assert "toolbar" not in help_text.lower(), "no toolbar exists yet"


def test_options_and_their_defaults() -> None:
    assert parse() == DemoOptions(simulate=None, port=8888, ip="127.0.0.1", open_browser=True)
    assert parse(
        "--simulate",
        "3",
        "--port",
        "9000",
        "--ip",
        "0.0.0.0",
        "--no-browser",
        "--state-dir",
        "/tmp/x",
        "--notebook-dir",
        "work",
    ) == DemoOptions(
        simulate=3,
        port=9000,
        ip="0.0.0.0",
        open_browser=False,
        state_dir=Path("/tmp/x"),
        notebook_dir=Path("work"),
    )


@pytest.mark.parametrize(
    "argv",
    [["--simulate", "-1"], ["--simulate", "two"], ["--port", "0"], ["--port", "70000"]],
    ids=["negative", "not-a-number", "port-0", "port-too-big"],
)
def test_bad_options_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", *argv]) == 2
    assert "jupyter gpu-hotplug demo: error: argument" in capsys.readouterr().err


def test_too_many_simulated_gpus_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--simulate", "65"]) == 1
    assert "--simulate must be from 0 to 64 GPUs" in capsys.readouterr().err


def test_a_user_who_is_not_root_is_told_why_and_what_to_run(busy_port: int) -> None:
    argv = ["demo", "--no-browser", f"--port={busy_port}"]
    if os.geteuid() == 0:
        command = [sys.executable, "-c", _AS_NOBODY, *argv]
    else:
        command = [str(JUPYTER), "gpu-hotplug", *argv]
    result = subprocess.run(command, capture_output=True, text=True, cwd="/", check=False)
    assert result.returncode == 1, result
    assert "The demo must run as root" in result.stderr
    assert "sudo " in result.stderr and "gpu-hotplug demo" in result.stderr
    assert "Traceback" not in result.stderr


@needs_root
def test_the_non_root_message_does_not_depend_on_where_the_installation_lives(
    busy_port: int, tmp_path: Path
) -> None:
    """A clone under /root, in a 0700 home or in a ``mktemp -d`` folder: the user who is told
    to run the demo as root cannot enter the installation's directory, and must still get the
    message (naming the installation's ``jupyter``), not a ``PermissionError``."""
    private = tmp_path / "private"
    venv = private / "venv"
    (venv / "bin").mkdir(parents=True)
    real_venv = Path(sys.prefix)
    (venv / "pyvenv.cfg").write_text((real_venv / "pyvenv.cfg").read_text())
    (venv / "lib").symlink_to(real_venv / "lib")
    (venv / "bin" / "python").symlink_to(Path(sys.executable).resolve())
    (venv / "bin" / "jupyter").symlink_to(JUPYTER)
    private.chmod(0o700)
    argv = ["demo", "--no-browser", f"--port={busy_port}"]
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _AS_NOBODY, *argv],
        capture_output=True,
        text=True,
        cwd="/",
        check=False,
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1, result
    assert "The demo must run as root" in result.stderr
    assert f"sudo {venv / 'bin' / 'jupyter'} gpu-hotplug demo" in result.stderr


@needs_root
def test_a_busy_port_is_refused_before_anything_starts(busy_port: int, tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    result = subprocess.run(
        [
            str(JUPYTER),
            "gpu-hotplug",
            "demo",
            "--no-browser",
            f"--port={busy_port}",
            f"--state-dir={state_dir}",
            "--simulate=1",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1, result
    assert f"Port {busy_port} on 127.0.0.1 is already in use" in result.stderr
    assert f"--port {busy_port + 1}" in result.stderr
    assert "Traceback" not in result.stderr
    assert not state_dir.exists(), "nothing was created"
    assert leftovers.processes_mentioning(str(state_dir)) == []
