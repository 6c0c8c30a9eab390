"""``%gpu`` in a real IPython shell, loaded the way users load it (``%load_ext``)."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from jupyter_gpu_hotplug import __version__
from jupyter_gpu_hotplug.kernel.magic import SUBCOMMANDS


@pytest.fixture
def shell(ipython_shell: InteractiveShell) -> InteractiveShell:
    ipython_shell.run_line_magic("load_ext", "jupyter_gpu_hotplug")
    return ipython_shell


def _run(shell: InteractiveShell, line: str, capsys: pytest.CaptureFixture[str]) -> str:
    shell.run_line_magic("gpu", line)
    return capsys.readouterr().out


@pytest.mark.parametrize("line", ["version", "--version"])
def test_version(shell: InteractiveShell, capsys: pytest.CaptureFixture[str], line: str) -> None:
    assert _run(shell, line, capsys) == f"jupyter-gpu-hotplug {__version__}\n"


@pytest.mark.parametrize("line", ["help", "--help", "-h"])
def test_help_lists_every_subcommand(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], line: str
) -> None:
    out = _run(shell, line, capsys)

    assert out.startswith("usage: %gpu")
    for command in SUBCOMMANDS:
        assert f"{command.name} " in out
        assert command.help in out


def test_help_of_one_subcommand(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _run(shell, "help version", capsys)

    assert out.startswith("usage: %gpu version")
    assert "print the jupyter-gpu-hotplug version" in out


def test_wait_is_described_as_what_it_does(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--wait`` is the time in the agent's queue; without it nothing waits (issues 11, 14)."""
    out = " ".join(_run(shell, "help attach", capsys).split())

    assert "wait in the agent's queue (first come, first served) for up to S seconds" in out
    assert "without --wait the attach fails at once" in out


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        pytest.param("bogus", "invalid choice: 'bogus'", id="unknown-subcommand"),
        pytest.param("version extra", "unrecognized arguments: extra", id="extra-argument"),
        pytest.param("--frob", "unrecognized arguments: --frob", id="unknown-option"),
        pytest.param("help nope", "invalid choice: 'nope'", id="unknown-help-topic"),
        pytest.param("'unbalanced", "No closing quotation", id="bad-quoting"),
    ],
)
def test_bad_input_is_a_usage_error(shell: InteractiveShell, line: str, expected: str) -> None:
    with pytest.raises(UsageError, match=expected):
        shell.run_line_magic("gpu", line)


def test_unknown_subcommand_error_lists_the_subcommands(shell: InteractiveShell) -> None:
    with pytest.raises(UsageError) as caught:
        shell.run_line_magic("gpu", "atach")

    message = str(caught.value)
    for command in SUBCOMMANDS:
        assert repr(command.name) in message
    assert "%gpu help" in message


def test_usage_error_in_a_cell_is_shown_not_raised(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    # What the notebook user sees: IPython reports UsageError briefly, the kernel keeps running.
    result = shell.run_cell("%gpu bogus")  # type: ignore[no-untyped-call]

    assert isinstance(result.error_in_exec, UsageError)
    assert "UsageError" in capsys.readouterr().err


def test_subcommand_names_are_unique() -> None:
    names = [command.name for command in SUBCOMMANDS]

    assert len(names) == len(set(names))
