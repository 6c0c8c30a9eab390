"""A new user's first hour with the demo (issue 14), end to end, as a user runs it.

The demo is started the way ``sudo`` starts it: with the system's ``PATH``, which does not
hold the virtualenv. Then, as a user would: open a notebook of one's own (a session, like a
browser tab), use ``%gpu`` without loading anything, run ``!python`` from the notebook, look at
who holds the GPUs (in the notebook and through the server extension), ask the agent from
another terminal with the line the banner prints, press Ctrl-C — and start the demo again to
find the notebook where it was.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import nbformat
import pytest

from jupyter_gpu_hotplug._structs import SANDBOX_PID_ENV

from ..fixtures.requirements import needs_root
from .conftest import DemoFactory

SANDBOX_PID = f"import os; print(os.environ[{SANDBOX_PID_ENV!r}])"
"""Prints the pid the agent names a kernel by (its sandbox's, not its own namespace's)."""

pytestmark = [*needs_root, pytest.mark.slow, pytest.mark.timeout(900)]

SUDO_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""Debian's ``secure_path``: the ``PATH`` of a command run with ``sudo``."""
NOTEBOOK = "mine.ipynb"
OTHER = "team/other.ipynb"


def sudo_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_HOTPLUG_", "VIRTUAL"))}
    env["PATH"] = SUDO_PATH
    return env


def test_a_new_users_first_hour(demo_factory: DemoFactory) -> None:
    demo = demo_factory(simulate=2, temporary=True, env=sudo_environment())
    notebooks = demo_factory.notebook_dir
    assert Path(demo.notebooks_line) == notebooks, "the banner says where notebooks are saved"
    assert notebooks != demo.layout.root and not notebooks.is_relative_to(demo.layout.root)
    server = demo.server

    # JupyterLab's "news?" prompt would cover the page: its setting defaults to "false".
    settings = server.request("GET", "lab/api/settings/@jupyterlab/apputils-extension:notification")
    assert settings.status == 200, settings
    assert settings.body["schema"]["properties"]["fetchNews"]["default"] == "false"

    # A notebook of one's own, opened as a browser tab opens it.
    notebook = nbformat.v4.new_notebook()  # type: ignore[no-untyped-call]
    saved = server.request(
        "PUT", f"api/contents/{NOTEBOOK}", {"type": "notebook", "content": notebook}
    )
    assert saved.status in (200, 201), saved
    assert server.request("PUT", "api/contents/team", {"type": "directory"}).status == 201
    kernel = server.start_session(NOTEBOOK)
    with server.connect(kernel) as session:
        attach = session.execute("%gpu attach 1")  # no %load_ext: the demo's kernels load it
        assert attach.status == "ok", attach.output
        assert "Attached 1 GPU to this kernel" in attach.stdout

        interpreter = session.run("import sys; print(sys.executable)").stdout.strip()
        shell = session.run(
            '!python -c "import sys, jupyter_gpu_hotplug; print(sys.executable)"'
        ).stdout.strip()
        assert Path(shell).resolve() == Path(interpreter).resolve(), shell

        # The demo's agent keeps its token and ledger out of every kernel's sight.
        token = demo.layout.agent_token
        assert token.is_file()
        hidden = session.run(f"import os; print(sorted(os.listdir({str(token.parent)!r})))")
        assert hidden.stdout.strip() == "[]", hidden.output

        pid = int(session.run(SANDBOX_PID).stdout)
        # A second notebook takes the other GPU: each names the other's holder by notebook.
        other_kernel = server.start_session(OTHER)
        with server.connect(other_kernel) as other_session:
            other_session.run("%gpu attach 1")
            other_pid = int(other_session.run(SANDBOX_PID).stdout)
            other_listing = "\n".join(other_session.run("%gpu list").results)
        listing = "\n".join(session.run("%gpu list").results)
        assert "attached  this notebook" in listing, listing
        # Another kernel is out of sight in a sandbox of its own (its own pid namespace): it
        # is named by process; the JupyterLab panel, served by the server, names its notebook.
        assert f"attached  process {other_pid}" in listing, listing
        assert f"attached  process {pid}" in other_listing, other_listing
        assert "attached  this notebook" in other_listing, other_listing

    view = server.request("GET", f"gpu-hotplug/api/gpus?kernel_id={kernel}")
    assert view.status == 200, view
    [held] = view.body["attached"]
    notebook_holder = {"kind": "notebook", "name": NOTEBOOK, "kernel_id": kernel}
    assert (held["target"], held["held_by"]) == ({"pid": pid}, notebook_holder)
    assert [g["held_by"] for g in view.body["node"] if g["uuid"] == held["uuid"]] == [
        notebook_holder
    ]

    # Another terminal: the banner's line reaches the demo's agent, not the default socket.
    other = subprocess.run(
        ["bash", "-c", demo.cli_line],
        capture_output=True,
        text=True,
        cwd="/",
        env=sudo_environment(),
        timeout=60,
        check=False,
    )
    assert other.returncode == 0, other
    [line] = [line for line in other.stdout.splitlines() if held["uuid"] in line]
    # The holder is named by its notebook (the session's path, as jupyter_server gives it,
    # found below the sandbox's pid).
    assert "attached -> /" in line and line.endswith(f"/{NOTEBOOK} (process {pid})"), line

    # Ctrl-C: the demo's own files go, the notebook stays.
    assert demo.interrupt() == 0, demo.logs()
    assert not demo.layout.root.exists()
    assert (notebooks / NOTEBOOK).is_file()

    # Started again, the notebook is where it was.
    again = demo_factory(simulate=1, temporary=True, env=sudo_environment())
    reopened = again.server.request("GET", f"api/contents/{NOTEBOOK}")
    assert reopened.status == 200, reopened
    assert reopened.body["type"] == "notebook"
    assert again.interrupt() == 0, again.logs()
