"""The GPU toolbar item, panel, status bar and notifications in a real browser, against the
demo: a real ``jupyter lab`` with the server extension, sandboxed kernels and a local-mode
agent with two simulated GPUs.

One demo and one Chromium serve the whole module (each start costs seconds); every test opens
its own notebooks (their own kernels) in pages of their own and leaves every GPU free.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import pytest
from playwright.sync_api import Browser, Locator, Response, expect

from jupyter_gpu_hotplug.nvml.sim import SimulatedProcess
from tests.demo.conftest import DemoFactory
from tests.demo.demo_process import DemoProcess
from tests.demo.leftovers import process_tree
from tests.fixtures.agent import update_simulated_gpu
from tests.fixtures.browser import needs_chromium
from tests.fixtures.requirements import needs_root

from .gpu_lab import DIALOG, LOAD_TIMEOUT_MS, PANEL, SETTLE_MS, TOOLBAR_ITEM, GpuLab, quiet_lab
from .screenshots import LOAD, SUSPENDED_NOTICE, fake_cuda, released_keeping_state, take_all

pytestmark = [*needs_root, *needs_chromium, pytest.mark.timeout(900)]

GPUS = 2
SCREENSHOTS_ENV = "GPU_HOTPLUG_SCREENSHOTS"
"""Where ``test_screenshots_of_the_real_demo`` writes (``docs/images`` to regenerate them)."""
CHECKPOINT_DIR_ENV = "FAKE_CUDA_CHECKPOINT_DIR"
"""The simulated CUDA driver's directory of checkpoint sockets (``nvml/sim/fakecuda.c``)."""


class OpenLab(Protocol):
    """``open_lab(name, cells)``: a page on a new notebook (``cells`` after the probe)."""

    def __call__(self, name: str, cells: tuple[str, ...] = ()) -> GpuLab: ...


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the simulated CUDA driver's processes answer the agent's checkpoint calls: the
    demo's agent and its kernels share it, so a release with keep can suspend a demo kernel's
    CUDA process (issue 39). Open to every sandbox, as the suspend test's is."""
    sockets = tmp_path_factory.mktemp("ckpt")
    sockets.chmod(0o777)
    return sockets


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, checkpoints: Path) -> Iterator[DemoProcess]:
    home = tmp_path_factory.mktemp("gpu-ui")
    factory = DemoFactory(home)
    try:
        started = factory(simulate=GPUS, env={**os.environ, CHECKPOINT_DIR_ENV: str(checkpoints)})
        quiet_lab(started.server)
        yield started
    finally:
        for demo in factory.demos:  # kept for a post-mortem: the demo's dir goes
            for log in (demo.layout.agent_log, demo.layout.lab_log):
                if log.exists():
                    shutil.copy(log, home / log.name)
        factory.close()


@pytest.fixture
def open_lab(chromium: Browser, demo: DemoProcess) -> Iterator[OpenLab]:
    """``open_lab(name)``: a page on a new notebook; pages close and GPUs are freed after."""
    pages: list[GpuLab] = []

    def open_page(name: str, cells: tuple[str, ...] = ()) -> GpuLab:
        lab = GpuLab.open(chromium, demo, name, cells=cells)
        pages.append(lab)
        return lab

    yield open_page
    for lab in pages:
        with contextlib.suppress(Exception):
            demo.server.request(
                "POST",
                "gpu-hotplug/api/detach",
                {"uuid": "all", "force": True, "kernel_id": lab.kernel_id()},
            )
        assert lab.log.page_errors == [], lab.log.page_errors
        lab.close()


def test_attach_through_the_toolbar_shows_everywhere_and_detach_takes_it_away(
    open_lab: OpenLab,
) -> None:
    lab = open_lab("first.ipynb")
    expect(lab.button).to_have_text(f"GPU · {GPUS} free")
    expect(lab.button).to_have_attribute(
        "aria-label", "GPUs: none attached to this notebook, 2 free"
    )
    expect(lab.summary).to_have_text(f"0 attached · {GPUS} free")
    assert lab.run_probe() == "[]"
    lab.open_panel()
    expect(lab.panel.locator("section[data-state='free']")).to_have_count(GPUS)

    lab.choose("Attach 1 GPU")

    expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-gpus"), timeout=SETTLE_MS)
    [gpu] = lab.attached()
    name = f"GPU {gpu['index']}"
    # The notification names the notebook that got the GPU.
    expect(lab.toast(f"Attached {name} ({gpu['device']}) to first.ipynb.")).to_be_visible(
        timeout=SETTLE_MS
    )
    expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-gpus"), timeout=SETTLE_MS)
    expect(lab.button).to_have_attribute("aria-label", "GPUs: 1 attached to this notebook, 1 free")
    expect(lab.summary).to_have_text(re.compile(r"^1 GPU · \d+ % · [\d.]+/80 GiB$"))
    expect(lab.panel_gpu(gpu["uuid"])).to_have_attribute("data-state", "mine")
    expect(lab.panel_gpu(gpu["uuid"])).to_contain_text("this notebook")
    # Temperature and power, as the widget has them (issue 36's panel).
    expect(lab.panel_gpu(gpu["uuid"]).locator(".jp-GpuHotplug-panel-vitals")).to_have_text(
        re.compile(r"^\d+ °C · \d+ W of \d+ W$")
    )
    line = lab.panel_gpu(gpu["uuid"]).locator("path.jp-GpuHotplug-chart-utilization")
    expect(line).to_have_attribute("d", re.compile(r"^M[\d.]+,[\d.]+L"), timeout=SETTLE_MS)
    assert lab.run_probe() == f"['{gpu['device']}']"

    lab.choose(f"Detach {name}")
    lab.confirm("Detach")

    expect(lab.toast(f"Detached {name} from first.ipynb.")).to_be_visible(timeout=SETTLE_MS)
    expect(lab.toolbar_item).not_to_have_class(re.compile("jp-mod-gpus"), timeout=SETTLE_MS)
    expect(lab.summary).to_have_text(f"0 attached · {GPUS} free", timeout=SETTLE_MS)
    expect(lab.panel.locator("section[data-state='free']")).to_have_count(GPUS, timeout=SETTLE_MS)
    assert lab.run_probe() == "[]"
    assert lab.attached() == []


def _host_pid_of(argv: list[str]) -> int:
    """The pid (host's view) of the one process whose command line is ``argv``."""
    wanted = "\0".join(argv) + "\0"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "cmdline").read_text() == wanted:
                    found.append(int(entry.name))
    assert len(found) == 1, (argv, found)
    return found[0]


def _ended(pid: int) -> bool:
    """Gone, or a zombie waiting for its parent (the kernel) to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_second_notebook_no_free_gpu_busy_gpu_and_force(
    open_lab: OpenLab, demo: DemoProcess
) -> None:
    owner, other = open_lab("owner.ipynb"), open_lab("other.ipynb")
    owner.choose("Attach 2 GPUs")
    expect(owner.toast("to owner.ipynb.")).to_be_visible(timeout=SETTLE_MS)
    taken = owner.attached()
    assert len(taken) == GPUS
    # The status bar sums both: count, mean utilisation, memory used of the total
    # (twice 79.6 GiB, the simulated H100's memory).
    expect(owner.summary).to_have_text(re.compile(r"^2 GPUs · \d+ % · [\d.]+/159 GiB$"))
    # Holding every GPU, the owner is not offered to wait for itself (issue 36, item 4):
    # the menu's first active item is a detach.
    owner.button.click()
    expect(owner.menu).to_be_visible()
    expect(owner.menu_item("Wait for a free GPU")).to_have_count(0)
    expect(owner.menu_item("This notebook has every GPU of the node")).to_have_class(
        re.compile("lm-mod-disabled")
    )
    active = owner.menu.locator(".lm-Menu-item.lm-mod-active .lm-Menu-itemLabel")
    expect(active).to_have_text(re.compile("^Detach GPU"))
    owner.page.keyboard.press("Escape")

    # The other notebook shows only its own GPUs (none); its panel shows them taken.
    expect(other.button).to_have_attribute(
        "aria-label", "GPUs: none attached to this notebook, 0 free", timeout=SETTLE_MS
    )
    expect(other.button).to_have_text("GPU · 0 free")
    other.open_panel()
    for gpu in taken:
        expect(other.panel_gpu(gpu["uuid"])).to_have_attribute("data-state", "attached")
        expect(other.panel_gpu(gpu["uuid"])).to_contain_text("held by owner.ipynb")

    # No free GPU: the command says what the server said, and offers to wait.
    other.palette("Attach GPUs to this notebook")
    refused = other.page.locator(".Toastify__toast--error")
    expect(refused).to_contain_text("other.ipynb: ", timeout=SETTLE_MS)
    expect(refused).to_contain_text("free")
    expect(refused).not_to_contain_text("Traceback")
    expect(refused.locator("button", has_text="Wait for a free GPU")).to_be_visible()
    # The menu offers to wait for one instead (the agent's queue).
    other.button.click()
    expect(other.menu_item("Wait for a free GPU and attach it")).not_to_have_class(
        re.compile("lm-mod-disabled")
    )
    other.page.keyboard.press("Escape")

    # A process in the owner's sandbox uses a GPU: a plain detach is refused and says so.
    gpu = taken[0]
    marker = str(6000 + os.getpid() % 1000)
    with demo.server.connect(owner.kernel_id()) as kernel:
        kernel.run(f"import subprocess; worker = subprocess.Popen(['sleep', '{marker}'])")
    worker = _host_pid_of(["sleep", marker])
    update_simulated_gpu(
        demo.layout.simulation_config,
        gpu["uuid"],
        processes=(SimulatedProcess(pid=worker, used_memory=None),),
    )
    owner.choose(f"Detach GPU {gpu['index']}")
    owner.confirm("Detach")
    busy = owner.page.locator(".Toastify__toast--error")
    expect(busy).to_contain_text(str(worker), timeout=SETTLE_MS)
    assert [g["uuid"] for g in owner.attached()] == [g["uuid"] for g in taken]

    # Force, from the notification: the dialog lists what will be ended, and Cancel has
    # the focus (an Enter out of habit ends nothing; issue 36, item 7).
    busy.locator("button", has_text="Force-detach").click()
    dialog = owner.page.locator(".jp-Dialog")
    expect(dialog).to_contain_text(f"{worker} sleep", timeout=SETTLE_MS)
    expect(dialog.locator("button", has_text="Cancel")).to_be_focused()
    owner.confirm("End processes and detach")

    expect(owner.toast(f"Force-detached GPU {gpu['index']} from owner.ipynb.")).to_be_visible(
        timeout=SETTLE_MS
    )
    assert [g["uuid"] for g in owner.attached()] == [taken[1]["uuid"]]
    assert _ended(worker)
    expect(other.panel_gpu(gpu["uuid"])).to_have_attribute("data-state", "free", timeout=SETTLE_MS)
    expect(other.button).to_have_attribute(
        "aria-label", "GPUs: none attached to this notebook, 1 free", timeout=SETTLE_MS
    )
    # The stale "no free GPU" error went when the GPU freed up.
    expect(refused).to_have_count(0, timeout=SETTLE_MS)


def test_agent_unreachable_is_shown_then_recovers_without_reload(
    open_lab: OpenLab, demo: DemoProcess
) -> None:
    lab = open_lab("offline.ipynb")
    lab.open_panel()
    socket = demo.layout.agent_socket
    away = socket.with_name(socket.name + ".away")
    socket.rename(away)
    try:
        expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-unreachable"), timeout=SETTLE_MS)
        expect(lab.button).to_have_attribute(
            "aria-label", "GPUs: the GPU service cannot be reached"
        )
        expect(lab.summary).to_have_text("GPU: disconnected")
        expect(lab.panel).to_have_class(re.compile("jp-mod-disconnected"))
        expect(lab.panel.locator("[role=alert]")).to_contain_text("No GPU agent")

        lab.palette("Attach GPUs to this notebook")
        expect(lab.page.locator(".Toastify__toast--error")).to_contain_text(
            "No GPU agent", timeout=SETTLE_MS
        )
    finally:
        away.rename(socket)

    expect(lab.toolbar_item).not_to_have_class(re.compile("jp-mod-unreachable"), timeout=SETTLE_MS)
    expect(lab.button).to_have_attribute("aria-label", re.compile("free$"))
    expect(lab.summary).to_have_text(re.compile(r"^0 attached · \d free$"))
    expect(lab.panel).not_to_have_class(re.compile("jp-mod-disconnected"))
    lab.choose("Attach 1 GPU")
    expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-gpus"), timeout=SETTLE_MS)


def test_messages_follow_the_state(open_lab: OpenLab, demo: DemoProcess) -> None:
    """Issue 36, item 3: a busy refusal stayed after its GPU was gone (its Force-detach then
    failed with "not attached"), and a ``%gpu detach`` in the notebook was announced as
    "the kernel restarted or the GPU sat unused"."""
    lab = open_lab("stale.ipynb")
    # The previous test's GPUs are freed when its pages close: wait for both.
    expect(lab.button).to_have_text(f"GPU · {GPUS} free", timeout=SETTLE_MS)
    lab.choose("Attach 1 GPU")
    expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-gpus"), timeout=SETTLE_MS)
    [gpu] = lab.attached()
    name = f"GPU {gpu['index']}"
    with demo.server.connect(lab.kernel_id()) as kernel:
        kernel.run(LOAD)  # the load helper holds the GPU: a plain detach is refused
    lab.choose(f"Detach {name}")
    lab.confirm("Detach")
    busy = lab.page.locator(".Toastify__toast--error")
    expect(busy.locator("button", has_text="Force-detach")).to_be_visible(timeout=SETTLE_MS)

    with demo.server.connect(lab.kernel_id()) as kernel:
        kernel.run("%gpu detach all --force")

    expect(busy).to_have_count(0, timeout=SETTLE_MS)
    expect(
        lab.toast(
            f"{name} detached from stale.ipynb by %gpu detach in the notebook or on the "
            "command line."
        )
    ).to_be_visible(timeout=SETTLE_MS)
    expect(lab.toast("the kernel restarted or the GPU sat unused")).to_have_count(0)


def test_the_pages_workspace_stays_with_the_demo_run(open_lab: OpenLab, demo: DemoProcess) -> None:
    """Issue 36, item 9: every demo and browser test left a workspace file in the user's
    ``~/.jupyter/lab/workspaces`` (25 after one CI run), and the user's next JupyterLab
    reopened their notebooks. They are now kept in the run's own state directory."""
    lab = open_lab("workspace.ipynb")
    lab.open_panel()  # a layout change: JupyterLab saves the workspace

    def saved(directory: Path) -> list[Path]:
        return sorted(directory.glob(f"{lab.workspace}*")) if directory.is_dir() else []

    expect(lab.panel).to_be_visible()
    deadline = time.monotonic() + SETTLE_MS / 1000
    while not saved(demo.layout.lab_workspaces):
        assert time.monotonic() < deadline, "no workspace saved in the run's directory"
        time.sleep(0.2)
    assert saved(Path.home() / ".jupyter" / "lab" / "workspaces") == []


def test_the_toolbar_item_stays_in_a_narrow_notebook(chromium: Browser, demo: DemoProcess) -> None:
    """Issue 36, item 9: at about 400 px the GPU item fell into the toolbar's "⋯" overflow;
    it now comes right after Save, so it is among the last to go."""
    lab = GpuLab.open(chromium, demo, "narrow.ipynb")
    try:
        lab.page.set_viewport_size({"width": 420, "height": 760})
        # The notebook alone (a 420 px page with the file browser open leaves it 90 px).
        left = lab.page.locator("#jp-left-stack")
        if left.is_visible():
            lab.page.locator(".jp-Notebook").first.click()
            lab.page.keyboard.press("Escape")
            lab.page.keyboard.press("Control+b")  # JupyterLab: show/hide the left side bar
        expect(left).to_be_hidden(timeout=SETTLE_MS)
        expect(lab.button).to_be_visible(timeout=SETTLE_MS)
        overflow = lab.page.locator(".jp-Toolbar-responsive-popup")
        expect(overflow.locator(TOOLBAR_ITEM)).to_have_count(0)
        assert lab.log.page_errors == []
    finally:
        lab.close()


def test_the_restart_dialog_says_the_gpus_go(open_lab: OpenLab) -> None:
    """Issue 36, item 7: JupyterLab's "Restart Kernel?" dialog did not say that a restart
    releases the kernel's GPUs."""
    lab = open_lab("restart.ipynb")
    # An earlier test's GPUs are freed when its pages close (a force-detach): wait for both.
    expect(lab.button).to_have_text(f"GPU · {GPUS} free", timeout=SETTLE_MS)
    lab.choose("Attach 1 GPU")
    expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-gpus"), timeout=SETTLE_MS)
    [gpu] = lab.attached()
    lab.page.locator(".jp-Notebook").first.click()
    lab.page.keyboard.press("Escape")  # command mode
    lab.page.keyboard.press("0")
    lab.page.keyboard.press("0")  # JupyterLab's "restart the kernel" shortcut

    dialog = lab.page.locator(DIALOG)
    expect(dialog).to_contain_text("Restart Kernel?", timeout=SETTLE_MS)
    expect(dialog.locator(".jp-GpuHotplug-restartWarning")).to_have_text(
        f"Its GPU (GPU {gpu['index']}) will be released: the restarted kernel starts without "
        "a GPU; attach again afterwards."
    )
    lab.confirm("Cancel")
    assert [g["uuid"] for g in lab.attached()] == [gpu["uuid"]]


def _points(lab: GpuLab, uuid: str) -> int:
    """How many readings the panel's utilisation line of GPU ``uuid`` draws now."""
    line = lab.panel_gpu(uuid).locator("path.jp-GpuHotplug-chart-utilization")
    expect(line).to_have_attribute("d", re.compile(r"^M[\d.]+,[\d.]+L"), timeout=SETTLE_MS)
    return (line.get_attribute("d") or "").count("L") + 1


def test_the_charts_history_is_the_servers(open_lab: OpenLab) -> None:
    """Issue 36's panel: the history is kept by the server for an hour, so a reload keeps
    it and another notebook shows the same; the panel offers 15 min and 1 h windows."""
    first = open_lab("history-1.ipynb")
    first.open_panel()
    uuid = first.panel.locator("section[data-uuid]").first.get_attribute("data-uuid")
    assert uuid is not None
    expect(first.panel_gpu(uuid).locator("path.jp-GpuHotplug-chart-utilization")).to_have_attribute(
        "d", re.compile(r"(L[^L]*){8}"), timeout=SETTLE_MS
    )
    seen = _points(first, uuid)
    expect(first.panel.locator("select option")).to_have_text(
        ["last 2 min", "last 3 min", "last 4 min", "last 5 min", "last 15 min", "last 60 min"]
    )

    with first.page.expect_response(_is_history, timeout=LOAD_TIMEOUT_MS) as history:
        first.page.reload()
    kept = history.value.json()["gpus"][uuid]
    assert len(kept) >= seen  # the server kept what the page drew before
    first.open_panel()
    other = open_lab("history-2.ipynb")
    other.open_panel()

    # Both draw what the server kept, merged with their own readings. The history's request
    # races the page's first live readings (the loaded CI machine once drew two points before
    # it): wait for the merge, never read once.
    for lab in (first, other):
        expect(
            lab.panel_gpu(uuid).locator("path.jp-GpuHotplug-chart-utilization")
        ).to_have_attribute("d", re.compile(rf"(L[^L]*){{{seen - 1}}}"), timeout=SETTLE_MS)


def _is_history(response: Response) -> bool:
    """The page's ``GET history`` (issue 36): the server's readings of the last hour."""
    return urlparse(response.url).path.endswith("/gpu-hotplug/api/history")


def _agent_pid(demo: DemoProcess) -> int:
    """The demo's node agent (a child of the demo), host pid."""
    found = [
        proc.pid
        for proc in process_tree(demo.process.pid)
        if "jupyter_gpu_hotplug.agent.app" in Path(f"/proc/{proc.pid}/cmdline").read_text()
    ]
    assert len(found) == 1, found
    return found[0]


def test_a_hung_agent_is_shown_as_disconnected_then_recovers(
    open_lab: OpenLab, demo: DemoProcess
) -> None:
    """Issue 36, item 2: a stopped agent keeps its socket, so only the client's timeouts
    (about 90 s) ended a reading, and until then every view showed the last values as live.
    Now the stream says "not answering" a few seconds in."""
    lab = open_lab("hung.ipynb")
    lab.open_panel()
    agent = _agent_pid(demo)
    os.kill(agent, signal.SIGSTOP)
    try:
        expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-unreachable"), timeout=SETTLE_MS)
        expect(lab.summary).to_have_text("GPU: disconnected")
        expect(lab.panel).to_have_class(re.compile("jp-mod-disconnected"))
        expect(lab.panel.locator("[role=alert]")).to_contain_text("has not answered for")
    finally:
        os.kill(agent, signal.SIGCONT)

    expect(lab.toolbar_item).not_to_have_class(re.compile("jp-mod-unreachable"), timeout=SETTLE_MS)
    expect(lab.summary).to_have_text(re.compile(r"^0 attached · \d free$"))
    expect(lab.panel).not_to_have_class(re.compile("jp-mod-disconnected"))


def test_keyboard_only_menu_and_no_serious_accessibility_violation(
    open_lab: OpenLab,
) -> None:
    lab = open_lab("keys.ipynb")
    page = lab.page
    # The GPU service answered this page (the menu built before would offer nothing to pick).
    expect(lab.button).to_have_attribute("aria-label", re.compile("free$"), timeout=SETTLE_MS)
    _open_menu_with_the_shortcut(lab)
    active = lab.menu.locator(".lm-Menu-item.lm-mod-active .lm-Menu-itemLabel")
    expect(active).to_have_text(re.compile("^Attach 1 GPU"))
    page.keyboard.press("ArrowDown")
    expect(active).to_have_text(re.compile("^Attach 2 GPUs"))
    page.keyboard.press("ArrowUp")
    page.keyboard.press("Enter")
    expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-gpus"), timeout=SETTLE_MS)
    expect(lab.button).to_be_focused()  # back where the keyboard user was

    page.keyboard.press("Enter")  # the focused button opens the menu
    expect(lab.menu).to_be_visible()
    expect(lab.button).to_have_attribute("aria-expanded", "true")
    page.keyboard.press("Escape")
    expect(lab.menu).to_be_hidden()
    expect(lab.button).to_be_focused()

    page.keyboard.press("Alt+Shift+G")
    expect(lab.panel.locator("section[data-state='mine']")).to_have_count(1, timeout=SETTLE_MS)
    # The shortcut moves the keyboard's focus into the panel (issue 36, item 7).
    expect(lab.panel).to_be_focused()
    assert lab.axe(TOOLBAR_ITEM, PANEL) == []

    lab.button.focus()
    page.keyboard.press("Enter")
    expect(lab.menu).to_be_visible()
    for _ in range(lab.menu.locator(".lm-Menu-item").count()):
        if active.inner_text().startswith("Detach GPU"):
            break
        page.keyboard.press("ArrowDown")
    expect(active).to_have_text(re.compile("^Detach GPU"))
    page.keyboard.press("Enter")
    expect(page.locator(".jp-Dialog")).to_be_visible(timeout=SETTLE_MS)
    page.keyboard.press("Enter")  # the dialog's default button: Detach
    expect(lab.toolbar_item).not_to_have_class(re.compile("jp-mod-gpus"), timeout=SETTLE_MS)
    assert lab.attached() == []


def _open_menu_with_the_shortcut(lab: GpuLab) -> None:
    """Focus the notebook in command mode and press Alt+G, the settable shortcut of "open this
    notebook's GPU menu", until the menu shows with "Attach 1 GPU" active. While the page still
    settles the key can reach something else (the focus moved: no menu) or the menu can show
    before the notebook's kernel is up (its attach items disabled, "Open the GPU panel" first):
    the menu is closed and the steps repeated, as a keyboard user would, never more than
    ``SETTLE_MS`` in all."""
    page = lab.page
    active = lab.menu.locator(".lm-Menu-item.lm-mod-active .lm-Menu-itemLabel")
    deadline = time.monotonic() + SETTLE_MS / 1000
    while True:
        page.locator(".jp-Notebook").first.click()
        page.keyboard.press("Escape")  # command mode: the notebook has the focus
        page.keyboard.press("Alt+G")
        try:
            expect(active).to_have_text(re.compile("^Attach 1 GPU"), timeout=5_000)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            page.keyboard.press("Escape")


@contextlib.contextmanager
def _notebook_sessions(demo: DemoProcess, *names: str) -> Iterator[list[str]]:
    """Kernels of notebook sessions ``names`` (the demo's default, sandboxed kernelspec),
    without a page each: the ids; the sessions end afterwards."""
    default = demo.server.request("GET", "api/kernelspecs").body["default"]
    sessions = []
    try:
        for name in names:
            answer = demo.server.request(
                "POST",
                "api/sessions",
                {"path": name, "type": "notebook", "kernel": {"name": default}},
            )
            assert answer.status == 201, answer
            sessions.append(answer.body)
        yield [session["kernel"]["id"] for session in sessions]
    finally:
        for session in sessions:
            demo.server.request("DELETE", f"api/sessions/{session['id']}")


def test_wait_in_the_queue_cancel_then_get_the_gpu_another_notebook_frees(
    open_lab: OpenLab, demo: DemoProcess
) -> None:
    with _notebook_sessions(demo, "queue-1.ipynb", "queue-2.ipynb") as (first, second):
        taken = []
        for kernel_id in (first, second):
            answer = demo.server.request(
                "POST", "gpu-hotplug/api/attach", {"count": 1, "kernel_id": kernel_id}
            )
            assert answer.status == 201, answer
            taken += answer.body["attachments"]
        third = open_lab("queue-3.ipynb")
        expect(third.button).to_have_attribute(
            "aria-label", "GPUs: none attached to this notebook, 0 free", timeout=SETTLE_MS
        )
        third.open_panel()
        expect(third.panel_gpu(taken[0]["uuid"])).to_contain_text("held by queue-1.ipynb")

        # Waiting, then cancelled from the notification: it leaves the queue.
        third.choose("Wait for a free GPU and attach it")
        waiting = third.toast("Waiting for a free GPU… position 1 of 1")
        expect(waiting).to_be_visible(timeout=SETTLE_MS)
        expect(third.button).to_have_attribute(
            "aria-label", "GPUs: waiting for a free GPU… position 1 of 1", timeout=SETTLE_MS
        )
        expect(third.button).to_have_text("queued #1")
        # The panel lists the queue: place, the waiting notebook, a countdown.
        queued = third.panel.locator(".jp-GpuHotplug-panel-queued")
        expect(queued.locator(".jp-GpuHotplug-panel-queuedText")).to_have_text(
            re.compile(r"^#1 of 1 queue-3\.ipynb \(this notebook\) waits for 1 GPU · .* left$")
        )
        waiting.locator("button", has_text="Cancel").click()
        expect(third.toast("queue-3.ipynb: stopped waiting for a free GPU.")).to_be_visible(
            timeout=SETTLE_MS
        )
        expect(third.button).to_have_text("GPU · 0 free", timeout=SETTLE_MS)
        expect(queued).to_have_count(0)
        assert third.attached() == []

        # Waiting again; the first notebook lets its GPU go: the third gets it, in its sandbox.
        third.choose("Wait for a free GPU and attach it")
        expect(third.toast("position 1 of 1")).to_be_visible(timeout=SETTLE_MS)
        freed = taken[0]
        answer = demo.server.request(
            "POST", "gpu-hotplug/api/detach", {"uuid": freed["uuid"], "kernel_id": first}
        )
        assert answer.status == 204, answer

        expect(third.toast(f"({freed['device']}) to queue-3.ipynb.")).to_be_visible(
            timeout=SETTLE_MS
        )
        expect(third.toolbar_item).to_have_class(re.compile("jp-mod-gpus"), timeout=SETTLE_MS)
        expect(third.button).to_have_text("GPU")
        assert [gpu["uuid"] for gpu in third.attached()] == [freed["uuid"]]
        assert third.run_probe() == f"['{freed['device']}']"
        demo.server.request("POST", "gpu-hotplug/api/detach", {"uuid": "all", "kernel_id": second})


def _plot_height(lab: GpuLab, uuid: str) -> float:
    box = lab.panel_gpu(uuid).locator(".jp-GpuHotplug-chart-plot").first.bounding_box()
    assert box is not None
    return box["height"]


def test_a_wait_of_the_magic_is_in_the_one_queue_and_can_be_cancelled_there(
    open_lab: OpenLab, demo: DemoProcess
) -> None:
    """Issue 36, item 5: ``%gpu attach 1 --wait`` waited in the agent's queue unseen by the
    panel, the toolbar and the status bar, and no queue row had a Cancel."""
    with _notebook_sessions(demo, "full-1.ipynb", "full-2.ipynb") as kernels:
        for kernel_id in kernels:
            answer = demo.server.request(
                "POST", "gpu-hotplug/api/attach", {"count": 1, "kernel_id": kernel_id}
            )
            assert answer.status == 201, answer
        lab = open_lab("magic-wait.ipynb", cells=("%gpu attach 1 --wait 300",))
        lab.open_panel()
        lab.page.locator(".jp-Cell .jp-InputArea-editor").nth(1).click()
        lab.page.keyboard.press("Shift+Enter")

        expect(lab.button).to_have_text("queued #1", timeout=SETTLE_MS)
        expect(lab.summary).to_have_text("GPU: queued #1")
        queued = lab.panel.locator(".jp-GpuHotplug-panel-queued")
        expect(queued.locator(".jp-GpuHotplug-panel-queuedText")).to_have_text(
            "#1 of 1 magic-wait.ipynb (this notebook) waits for 1 GPU"
        )
        queued.locator("button", has_text="Cancel").click()

        expect(queued).to_have_count(0, timeout=SETTLE_MS)
        expect(lab.button).to_have_text("GPU · 0 free", timeout=SETTLE_MS)
        expect(lab.cell_output(1)).to_contain_text("cancel", timeout=SETTLE_MS)
        assert lab.attached() == []


LABEL_GAP_PX = 12
"""The least room between two time labels for them to read as separate (issue 36, item 9)."""


def _assert_time_labels_apart(chart: Locator) -> None:
    """The chart's time labels, left to right, leave ``LABEL_GAP_PX`` between each other."""
    boxes = [
        box
        for label in chart.locator(".jp-GpuHotplug-chart-x text").all()
        if (box := label.bounding_box()) is not None
    ]
    boxes.sort(key=lambda box: box["x"])
    gaps = [b["x"] - (a["x"] + a["width"]) for a, b in itertools.pairwise(boxes)]
    assert len(boxes) >= 2 and all(gap >= LABEL_GAP_PX for gap in gaps), gaps


def test_panel_charts_have_axes_legend_tooltip_and_grow_with_the_panel(
    open_lab: OpenLab,
) -> None:
    lab = open_lab("charts.ipynb")
    page = lab.page
    # The status bar item opens the panel.
    lab.status.click()
    expect(lab.panel).to_be_visible(timeout=SETTLE_MS)
    lab.choose("Attach 1 GPU")
    expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-gpus"), timeout=SETTLE_MS)
    [gpu] = lab.attached()
    group = lab.panel_gpu(gpu["uuid"])
    expect(group).to_have_attribute("data-state", "mine")

    # Axes with labelled ticks and units, a legend per chart.
    utilisation, memory = group.locator(".jp-GpuHotplug-chart").all()[:2]
    expect(utilisation.locator(".jp-GpuHotplug-chart-title")).to_have_text("Utilisation (%)")
    expect(memory.locator(".jp-GpuHotplug-chart-title")).to_have_text("Memory (GiB)")
    # The y axis reaches the whole range: 100 %, and the GPU's 79.6 GiB (a round tick above).
    for chart, top in ((utilisation, "^100$"), (memory, "^(80|100)$")):
        ticks = chart.locator(".jp-GpuHotplug-chart-y text")
        expect(ticks.first).to_have_text("0")
        expect(ticks.last).to_have_text(re.compile(top))
        expect(chart.locator(".jp-GpuHotplug-chart-x text").last).to_have_text("\u22122 min")
        expect(chart.locator(".jp-GpuHotplug-chart-x text").first).to_have_text("now")
    expect(utilisation.locator(".jp-GpuHotplug-chart-legend li")).to_have_text(
        ["GPU busy", "memory bandwidth"]
    )
    expect(memory.locator(".jp-GpuHotplug-chart-legend li")).to_have_text(["used", "total 80 GiB"])
    expect(utilisation.locator("svg.jp-GpuHotplug-chart-svg")).to_have_attribute(
        "aria-label", re.compile(r"^Utilisation, last 2 min: GPU busy \d+ %")
    )

    # Hovering shows the values nearest the pointer, in both charts of the GPU.
    expect(utilisation.locator("path.jp-GpuHotplug-chart-utilization")).to_have_attribute(
        "d", re.compile("L"), timeout=SETTLE_MS
    )
    box = utilisation.locator("svg.jp-GpuHotplug-chart-svg").bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] - 14, box["y"] + box["height"] / 2)
    expect(utilisation.locator(".jp-GpuHotplug-chart-tooltip")).to_contain_text("GPU busy: ")
    expect(memory.locator(".jp-GpuHotplug-chart-tooltip")).to_contain_text("used: ")

    _assert_time_labels_apart(utilisation)

    # A time window of 5 minutes instead.
    lab.panel.locator("select").select_option("5")
    expect(utilisation.locator(".jp-GpuHotplug-chart-x text").last).to_have_text("\u22125 min")
    _assert_time_labels_apart(utilisation)

    # A taller page gives the panel, and so the charts, more height.
    before = _plot_height(lab, gpu["uuid"])
    # Tall enough for both GPUs' four charts, attribution and vitals to leave room to grow.
    page.set_viewport_size({"width": 1280, "height": 2600})
    page.wait_for_function(
        "([sel, h]) => document.querySelector(sel).getBoundingClientRect().height > h",
        arg=[f"section[data-uuid='{gpu['uuid']}'] .jp-GpuHotplug-chart-plot", before],
        timeout=SETTLE_MS,
    )
    assert _plot_height(lab, gpu["uuid"]) > before

    # What the charts show, as CSV (issue 36's panel).
    with page.expect_download() as download:
        lab.panel.get_by_role("button", name="Export the charts as CSV").click()
    assert re.fullmatch(r"gpu-charts-[0-9T-]+Z\.csv", download.value.suggested_filename)
    rows = Path(download.value.path()).read_text().splitlines()
    assert rows[0].startswith("time_utc,gpu_index,gpu_uuid,utilization_percent,"), rows[:2]
    assert rows[0].endswith(",nvlink_tx_bytes_per_second,nvlink_rx_bytes_per_second"), rows[0]
    assert any(f",{gpu['index']},{gpu['uuid']}," in row for row in rows[1:]), rows[:5]

    # Open in the main area: a dockable tab of its own with the same charts.
    lab.panel.locator("button", has_text="Open in main area").click()
    main = page.locator("#jp-gpu-hotplug-main")
    expect(main).to_be_visible(timeout=SETTLE_MS)
    expect(main.locator(f"section[data-uuid='{gpu['uuid']}']")).to_have_attribute(
        "data-state", "mine"
    )
    # The side panel made room for it (the same view twice is noise; issue 36, item 9).
    expect(lab.panel).to_be_hidden()


def test_a_cards_attach_attaches_that_cards_gpu(open_lab: OpenLab, demo: DemoProcess) -> None:
    """Issue 36 item 6: each GPU card's Attach attached *a* free GPU (the first one). The
    second card's Attach must attach the second GPU, while the first stays free."""
    lab = open_lab("card.ipynb")
    lab.open_panel()
    node = demo.server.request("GET", "gpu-hotplug/api/gpus").body["node"]
    first, second = node
    assert first["state"] == second["state"] == "free"
    card = lab.panel_gpu(second["uuid"])
    attach = card.get_by_role("button", name="Attach", exact=True)
    expect(attach).to_have_attribute("title", f"Attach GPU {second['index']} to this notebook")

    attach.click()

    expect(card).to_have_attribute("data-state", "mine", timeout=SETTLE_MS)
    assert [gpu["uuid"] for gpu in lab.attached()] == [second["uuid"]]
    expect(lab.panel_gpu(first["uuid"])).to_have_attribute("data-state", "free")
    expect(lab.toast(f"Attached GPU {second['index']} ({second['device']})")).to_be_visible(
        timeout=SETTLE_MS
    )


def _traffic_chart(lab: GpuLab, uuid: str, link: str) -> Locator:
    """GPU ``uuid``'s ``pcie`` or ``nvlink`` chart in the panel."""
    return lab.panel_gpu(uuid).locator(f".jp-GpuHotplug-chart[data-chart='{link}']")


NONZERO_RATE = r"[1-9][\d.]* [kMGT]?B/s"
"""A rate above 0 as the charts write it ("2.3 GB/s", "640 kB/s")."""


def test_pcie_and_nvlink_charts_under_load(open_lab: OpenLab, demo: DemoProcess) -> None:
    """Issue 36: nvdashboard's PCIe and NVLink throughput. Under the load helper, each GPU's
    PCIe chart shows received and sent bytes/s above 0, in a unit that reaches them; the
    demo's GPU 0 has NVLinks and an NVLink chart, GPU 1 has none — no chart rather than a
    flat 0. Hovering one chart shows the same moment in the traffic charts too."""
    lab = open_lab("traffic.ipynb")
    expect(lab.button).to_have_text(f"GPU · {GPUS} free", timeout=SETTLE_MS)
    lab.open_panel()
    lab.choose("Attach 2 GPUs")
    expect(lab.button).to_have_text("GPU \u00d72", timeout=SETTLE_MS)
    linked, unlinked = sorted(lab.attached(), key=lambda gpu: gpu["index"])
    assert (linked["index"], unlinked["index"]) == (0, 1)
    with demo.server.connect(lab.kernel_id()) as kernel:
        kernel.run(LOAD)

    for gpu in (linked, unlinked):
        pcie = _traffic_chart(lab, gpu["uuid"], "pcie")
        expect(pcie.locator("svg.jp-GpuHotplug-chart-svg")).to_have_attribute(
            "aria-label",
            re.compile(rf"^PCIe, last 2 min: received {NONZERO_RATE}, sent {NONZERO_RATE}$"),
            timeout=SETTLE_MS,
        )
        expect(pcie.locator(".jp-GpuHotplug-chart-title")).to_have_text(
            re.compile(r"^PCIe \([kMGT]?B/s\)$")
        )
        expect(pcie.locator(".jp-GpuHotplug-chart-legend li")).to_have_text(["received", "sent"])
    nvlink = _traffic_chart(lab, linked["uuid"], "nvlink")
    expect(nvlink.locator("svg.jp-GpuHotplug-chart-svg")).to_have_attribute(
        "aria-label",
        re.compile(rf"^NVLink, last 2 min: received {NONZERO_RATE}, sent {NONZERO_RATE}$"),
        timeout=SETTLE_MS,
    )
    expect(nvlink).to_be_visible()
    expect(_traffic_chart(lab, unlinked["uuid"], "nvlink")).to_be_hidden()

    utilisation = lab.panel_gpu(linked["uuid"]).locator(".jp-GpuHotplug-chart").first
    box = utilisation.locator("svg.jp-GpuHotplug-chart-svg").bounding_box()
    assert box is not None
    lab.page.mouse.move(box["x"] + box["width"] - 14, box["y"] + box["height"] / 2)
    tooltip = _traffic_chart(lab, linked["uuid"], "pcie").locator(".jp-GpuHotplug-chart-tooltip")
    expect(tooltip).to_contain_text("received: ")


def test_magic_detach_by_node_index(open_lab: OpenLab, demo: DemoProcess) -> None:
    lab = open_lab("magic.ipynb")
    expect(lab.button).to_have_text(f"GPU · {GPUS} free", timeout=SETTLE_MS)
    lab.choose("Attach 2 GPUs")
    expect(lab.button).to_have_text("GPU \u00d72", timeout=SETTLE_MS)
    with demo.server.connect(lab.kernel_id()) as kernel:
        kernel.run("%gpu detach 0")
    assert [gpu["index"] for gpu in lab.attached()] == [1]
    expect(lab.button).to_have_text("GPU", timeout=SETTLE_MS)
    # The other GPU is named by the node's index, with the kernel's CUDA index beside it.
    lab.button.click()
    expect(lab.menu_item("Detach GPU 1 (cuda:0 in this notebook)")).to_be_visible()
    lab.page.keyboard.press("Escape")


def test_the_status_live_region_speaks_only_when_the_state_changes(
    open_lab: OpenLab, demo: DemoProcess
) -> None:
    lab = open_lab("speech.ipynb")
    live = lab.status.locator("[role=status]")
    expect(live).to_have_text("No GPU attached, 2 free")
    lab.choose("Attach 1 GPU")
    expect(live).to_have_text("1 GPU attached", timeout=SETTLE_MS)
    with demo.server.connect(lab.kernel_id()) as kernel:
        kernel.run(LOAD)  # the simulated GPU works: its readings move every second
    # The visible summary moves with every reading; the live region does not.
    text = lab.summary
    seen: set[str] = set()
    spoken: set[str] = set()
    while len(seen) < 4:
        current = text.inner_text()
        if current not in seen:
            seen.add(current)
            spoken.add(lab.status.aria_snapshot())
            expect(text).not_to_have_text(current, timeout=SETTLE_MS)
    assert {snapshot.count("1 GPU attached") for snapshot in spoken} == {1}, spoken
    assert len({s.split("status:")[-1] for s in spoken}) == 1, spoken


def test_the_widget_fits_400_pixels_without_a_horizontal_scrollbar(open_lab: OpenLab) -> None:
    lab = open_lab("narrow.ipynb", ("%gpu",))
    # The menu lists "Attach 1 GPU" only while the toolbar's reading has a free GPU: wait for
    # that reading (on a loaded CI run the menu once opened without the item, and the click
    # waited in vain).
    expect(lab.button).to_have_text(f"GPU · {GPUS} free", timeout=SETTLE_MS)
    lab.choose("Attach 1 GPU")
    expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-gpus"), timeout=SETTLE_MS)
    lab.run_all()
    widget = lab.cell_output(1)
    expect(widget.locator(".gpuhp-row")).to_have_count(1, timeout=SETTLE_MS)
    # The widget's output 400 px wide (a split view): nothing in it scrolls sideways.
    output = widget.locator(".jp-OutputArea-output").filter(has=lab.page.locator(".gpuhp-row"))
    output.evaluate("(o) => { o.style.width = '400px'; o.style.maxWidth = '400px'; }")
    expect(output).to_have_css("width", "400px")
    # Elements that would show a horizontal scrollbar: scrollable sideways, and too wide.
    overflowing = output.evaluate(
        "(area) => [area, ...area.querySelectorAll('*')]"
        ".filter(e => getComputedStyle(e).overflowX !== 'visible')"
        ".filter(e => e.scrollWidth > e.clientWidth + 1)"
        ".map(e => e.className)"
    )
    assert overflowing == []
    box = output.bounding_box()
    row = output.locator(".gpuhp-row").bounding_box()
    assert box is not None and row is not None
    assert row["x"] + row["width"] <= box["x"] + box["width"] + 1
    expect(output.locator("button", has_text="Force-detach")).to_be_in_viewport()


def test_screenshots_of_the_real_demo(open_lab: OpenLab, demo: DemoProcess, tmp_path: Path) -> None:
    """Regenerates ``docs/images`` when ``GPU_HOTPLUG_SCREENSHOTS=docs/images`` is set."""
    out = Path(os.environ.get(SCREENSHOTS_ENV) or tmp_path)
    for path in take_all(open_lab, demo, out):
        assert path.stat().st_size > 2000, path


def test_the_panel_says_which_notebook_uses_a_gpu(open_lab: OpenLab, demo: DemoProcess) -> None:
    """Issue 36: with two notebooks each holding a GPU, the one running the load helper is
    named under its GPU, with its memory, on both pages (highlighted on its own), and the
    other notebook's idle GPU names nobody."""
    busy = open_lab("busy.ipynb")
    idle = open_lab("idle.ipynb")
    for lab in (busy, idle):
        lab.choose("Attach 1 GPU")
        # The menu starts the attach; the REST API lists the GPU once it is done.
        expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-gpus"), timeout=SETTLE_MS)
    [used] = busy.attached()
    [unused] = idle.attached()
    with demo.server.connect(busy.kernel_id()) as kernel:
        kernel.run(LOAD)
    busy.open_panel()
    idle.open_panel()

    rows = ".jp-GpuHotplug-panel-byKernel-row"
    busy_rows = f"{rows}[data-kernel-id='{busy.kernel_id()}']"
    own = busy.panel_gpu(used["uuid"]).locator(busy_rows)
    expect(own).to_have_count(1, timeout=SETTLE_MS)
    expect(own).to_have_attribute("aria-current", "true")
    expect(own).to_have_text(re.compile(r"^busy\.ipynb \(this notebook\)[\d.]+ GiB"))
    seen_elsewhere = idle.panel_gpu(used["uuid"]).locator(busy_rows)
    expect(seen_elsewhere).to_have_text(re.compile(r"^busy\.ipynb[\d.]+ GiB"), timeout=SETTLE_MS)
    expect(seen_elsewhere).not_to_have_attribute("aria-current", "true")
    for lab in (busy, idle):
        expect(lab.panel_gpu(unused["uuid"]).locator(rows)).to_have_count(0)
        expect(lab.page.locator(f"{rows}[data-kernel-id='{idle.kernel_id()}']")).to_have_count(0)


def test_a_release_with_keep_shows_suspended_until_an_attach_resumes(
    open_lab: OpenLab, demo: DemoProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Issue 39 in the lab: the toolbar menu's "Release all, keep the kernel's state" suspends
    the kernel's CUDA process (the notification says so, as ``%gpu release --keep`` does); the
    toolbar, the status bar and the panel say the state waits in host memory and that
    attaching resumes it; the menu offers the resume in place of "Attach N", and it resumes the
    kernel: the suspended state goes."""
    lab = open_lab("suspend.ipynb")
    expect(lab.button).to_have_text(f"GPU · {GPUS} free")
    gpu = released_keeping_state(lab, demo, fake_cuda(tmp_path_factory.mktemp("cuda")))
    with demo.server.connect(lab.kernel_id()) as kernel:
        expect(
            lab.toast(
                "Released all GPUs of suspend.ipynb. This notebook's kernel is suspended "
                "(state kept, 5.0 MiB in host memory)"
            )
        ).to_be_visible()
        expect(lab.button).to_have_text("GPU · suspended")
        expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-suspended"))
        expect(lab.button).to_have_attribute(
            "aria-label",
            re.compile(
                r"This notebook's kernel is suspended \(state kept, 5\.0 MiB in host memory\); "
                r"attaching resumes it on 1 free NVIDIA H100 80GB HBM3 GPU"
            ),
        )
        expect(lab.summary).to_have_text(f"GPU: suspended · {GPUS} free")
        notice = lab.panel.locator(SUSPENDED_NOTICE)
        expect(notice).to_have_text(
            re.compile(r"^This notebook's kernel is suspended .* attaching resumes it")
        )

        lab.choose("Resume on 1 GPU")

        expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-gpus"))
        expect(lab.toolbar_item).not_to_have_class(re.compile("jp-mod-suspended"))
        expect(lab.summary).not_to_have_text(re.compile("suspended"))
        expect(lab.button).to_have_text("GPU")
        expect(notice).to_be_hidden()
        assert kernel.run("print(cuda.poll())").stdout.strip() == "None", "resumed, not ended"
    [resumed] = lab.attached()
    assert resumed["uuid"] == gpu["uuid"], "its GPU was free: the resume takes it again"
