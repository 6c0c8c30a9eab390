"""``jupyter gpu-hotplug``: parsing, dispatch and exit codes, in-process and as a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_gpu_hotplug import __version__
from jupyter_gpu_hotplug.cli import COMMANDS, EXIT_OK, EXIT_USAGE, main

REPO_ROOT = Path(__file__).resolve().parent.parent
VERSION_LINE = f"jupyter-gpu-hotplug {__version__}\n"


@pytest.mark.parametrize("argv", [["--version"], ["version"]])
def test_version(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == EXIT_OK
    assert capsys.readouterr().out == VERSION_LINE


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == EXIT_OK

    out = capsys.readouterr().out
    assert out.startswith("usage: jupyter gpu-hotplug")
    for command in COMMANDS:
        assert command.name in out
        assert command.help in out


def test_help_of_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version", "--help"]) == EXIT_OK
    assert capsys.readouterr().out.startswith("usage: jupyter gpu-hotplug version")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param([], "the following arguments are required: COMMAND", id="no-command"),
        pytest.param(["bogus"], "invalid choice: 'bogus'", id="unknown-command"),
        pytest.param(["version", "--frob"], "unrecognized arguments: --frob", id="unknown-option"),
        pytest.param(["version", "extra"], "unrecognized arguments: extra", id="extra-argument"),
    ],
)
def test_usage_errors_exit_2_with_usage_on_stderr(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == EXIT_USAGE

    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: jupyter gpu-hotplug")
    (error_line,) = (line for line in captured.err.splitlines() if "error:" in line)
    assert error_line.startswith("jupyter gpu-hotplug: error: ")
    assert expected in error_line


def test_unknown_command_error_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["atach"]) == EXIT_USAGE

    err = capsys.readouterr().err
    for command in COMMANDS:
        assert repr(command.name) in err


def test_command_names_are_unique() -> None:
    names = [command.name for command in COMMANDS]

    assert len(names) == len(set(names))


def _run_module(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jupyter_gpu_hotplug.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_runs_as_a_module() -> None:
    result = _run_module("--version")

    assert (result.returncode, result.stdout, result.stderr) == (EXIT_OK, VERSION_LINE, "")


def test_module_exit_code_on_usage_error() -> None:
    result = _run_module("bogus")

    assert result.returncode == EXIT_USAGE
    assert "invalid choice: 'bogus'" in result.stderr
