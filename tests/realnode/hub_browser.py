"""A user of the real node's hub in Chromium: the login page, the spawn form, the Lab of the
started server with the notebook ``gpu.ipynb`` open.

Why a module of its own: the hub tier's browser tests (``test_hub.py``) and the benchmark of
the user's path (``benchmarks/bench_hub_path.py``) walk the same pages; the benchmark times
each step the tests take, so the steps are written once, here.
"""

from __future__ import annotations

import re
import secrets
from typing import Final

from playwright.sync_api import Browser, Page, expect

from ..browser.gpu_lab import LOAD_TIMEOUT_MS, GpuLab, write_notebook
from ..fixtures.browser import PageLog
from .hub import Hub, UserServer

NVML_PROBE: Final = (
    "import json, pynvml\n"
    "try:\n"
    "    pynvml.nvmlInit()\n"
    "    n = pynvml.nvmlDeviceGetCount()\n"
    "    print(json.dumps([pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))"
    " for i in range(n)]))\n"
    "except pynvml.NVMLError as e:\n"
    "    print(json.dumps(str(e)))\n"
)
"""What a kernel asks NVML: the UUIDs it sees, or NVML's error (no library, no GPU)."""
CELLS: Final = (
    "%load_ext jupyter_gpu_hotplug\n%gpu status",
    NVML_PROBE,
)
"""After the probe (device nodes): the magic's status, then what NVML says in the kernel."""
SPAWN_TIMEOUT_MS: Final = 600_000
"""Upper bound for a spawn on a loaded 2-core machine (never asserted on as a time)."""
NOTEBOOK: Final = "gpu.ipynb"


def log_in(chromium: Browser, hub: Hub, user: str) -> tuple[Page, PageLog]:
    """A new browser context logged in as ``user`` (the shared password), on the spawn form
    with its default profile, "CPU only", chosen."""
    context = chromium.new_context(viewport={"width": 1280, "height": 760})
    page = context.new_page()
    log = PageLog()
    page.on("console", log.record_console)
    page.on("pageerror", log.record_page_error)
    # To the spawn form once logged in: without ``next`` the hub sends a user whose server
    # stopped a moment ago to "Server not running" (its last URL, the server's).
    page.goto(f"{hub.url}/hub/login?next=%2Fhub%2Fspawn", timeout=LOAD_TIMEOUT_MS)
    page.fill("#username_input", user)
    page.fill("#password_input", hub.password)
    page.click("#login_submit")
    default = page.locator("input[name='profile'][value='cpu']")
    expect(default).to_be_checked(timeout=LOAD_TIMEOUT_MS)
    return page, log


def spawn(page: Page, user: str, profile: str | None = None) -> None:
    """Start on the spawn form (``profile`` chosen, else the default); return once the hub
    has redirected to the started server's Lab."""
    if profile is not None:
        page.locator(f"input[name='profile'][value='{profile}']").check()
    page.locator("form#spawn_form [type='submit']").click()
    page.wait_for_url(re.compile(rf"/user/{user}/lab"), timeout=SPAWN_TIMEOUT_MS)


def open_notebook(page: Page, log: PageLog, hub: Hub, user: str) -> tuple[GpuLab, UserServer]:
    """``gpu.ipynb`` (the probe, then ``CELLS``) written into the user's server and opened in
    a workspace of its own; returns once its kernel is up and the toolbar says how many GPUs
    are free."""
    host = hub.user_server(user)
    write_notebook(host.server, NOTEBOOK, CELLS)
    workspace = f"w{secrets.token_hex(4)}"
    url = f"{host.base_url}/lab/workspaces/{workspace}/tree/{NOTEBOOK}"
    page.goto(url, timeout=LOAD_TIMEOUT_MS)
    lab = GpuLab(page, log, host, NOTEBOOK, workspace)
    expect(lab.button).to_have_attribute(
        "aria-label", re.compile(r"free$"), timeout=LOAD_TIMEOUT_MS
    )
    return lab, host


def log_in_and_start(
    chromium: Browser, hub: Hub, user: str, profile: str | None = None
) -> tuple[GpuLab, UserServer]:
    """As a user does: log in, Start on the spawn form, then ``gpu.ipynb`` in the Lab."""
    page, log = log_in(chromium, hub, user)
    spawn(page, user, profile)
    return open_notebook(page, log, hub, user)
