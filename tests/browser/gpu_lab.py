"""The demo's JupyterLab as a user sees it: one notebook page, its GPU toolbar item, the GPU
panel, the status bar and the notifications, driven through Playwright.

Why a module of its own: the browser tests and the screenshot script (``screenshots.py``)
walk the same screens; selectors and the steps to reach a state are written once, here, and
mirror ``labextension/src/constants.ts``.
"""

from __future__ import annotations

import json
import re
import secrets
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from playwright.sync_api import Browser, Locator, Page, expect

from tests.demo.jupyter_api import JupyterServer
from tests.fixtures.browser import PageLog

LABEXTENSION: Final = Path(__file__).parents[2] / "labextension"
AXE: Final = LABEXTENSION / "node_modules" / "axe-core" / "axe.min.js"
"""axe-core from npm (a devDependency of the labextension, installed by ``.ci/setup``)."""

BUTTON: Final = ".jp-GpuHotplug-toolbarButton button"
TOOLBAR_ITEM: Final = ".jp-GpuHotplug-toolbarButton"
MENU: Final = ".lm-Menu.jp-GpuHotplug-menu"
STATUS: Final = "#jp-gpu-hotplug-gpus-status"
STATUS_TEXT: Final = f"{STATUS} .jp-GpuHotplug-gpuStatus-text"
"""The status item's visible summary (beside it, a visually hidden live region)."""
PANEL: Final = "#jp-gpu-hotplug-panel"
TOAST: Final = ".Toastify__toast"
DIALOG: Final = ".jp-Dialog"
NOTEBOOK_PANEL: Final = ".jp-NotebookPanel"

LOAD_TIMEOUT_MS: Final = 120_000
SETTLE_MS: Final = 60_000
"""Upper bounds for waiting (shared 2-core machines); never asserted as durations."""

# Every expectation waits up to SETTLE_MS (Playwright's default is 5 s: too short on a
# loaded 2-core machine). An upper bound for waiting, never an asserted duration.
expect.set_options(timeout=SETTLE_MS)

PROBE: Final = "import glob; print('NODES', sorted(glob.glob('/dev/nvidia[0-9]*')))"
"""The notebook's one cell: which GPU device nodes the kernel's sandbox has."""
_NODES: Final = re.compile(r"NODES (\[.*\])")

SETTINGS: Final = {
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}
}
"""Silences the news toast, which would cover our notifications and the status bar."""


def quiet_lab(server: JupyterServer, *, theme: str = "JupyterLab Light") -> None:
    """User settings for a clean page: no news toast, the given theme."""
    settings: dict[str, dict[str, Any]] = {
        **SETTINGS,
        "@jupyterlab/apputils-extension:themes": {"theme": theme},
    }
    for plugin, values in settings.items():
        answer = server.request("PUT", f"lab/api/settings/{plugin}", {"raw": json.dumps(values)})
        assert answer.status == 204, answer


def _code_cell(number: int, source: str) -> dict[str, Any]:
    return {
        "cell_type": "code",
        "id": "probe" if number == 0 else f"cell-{number}",
        "source": source,
        "metadata": {},
        "outputs": [],
        "execution_count": None,
    }


def write_notebook(server: JupyterServer, name: str, cells: tuple[str, ...] = ()) -> None:
    """A notebook with the probe cell (then ``cells``) and the demo's (sandboxed) Python
    kernel."""
    notebook = {
        "type": "notebook",
        "content": {
            "nbformat": 4,
            "nbformat_minor": 5,
            "metadata": {
                "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
            },
            "cells": [_code_cell(i, source) for i, source in enumerate((PROBE, *cells))],
        },
    }
    answer = server.request("PUT", f"api/contents/{name}", notebook)
    assert answer.status in (200, 201), answer


class LabHost(Protocol):
    """Where the Lab runs: the demo (``DemoProcess``), or a user's server behind a hub."""

    @property
    def base_url(self) -> str: ...

    @property
    def token(self) -> str: ...

    @property
    def server(self) -> JupyterServer: ...

    def logs(self) -> str:
        """What the server wrote, or where to find it: for failure messages."""
        ...


@dataclass
class GpuLab:
    """One page showing one notebook of the demo (or of another ``LabHost``)."""

    page: Page
    log: PageLog
    demo: LabHost
    notebook: str
    workspace: str = ""
    """The JupyterLab workspace the page opened (its own)."""

    @classmethod
    def open(
        cls, browser: Browser, demo: LabHost, notebook: str, *, cells: tuple[str, ...] = ()
    ) -> GpuLab:
        """A new browser context on ``notebook`` (created, with ``cells`` after the probe),
        in a workspace of its own."""
        write_notebook(demo.server, notebook, cells)
        context = browser.new_context(viewport={"width": 1280, "height": 760})
        page = context.new_page()
        log = PageLog()
        page.on("console", log.record_console)
        page.on("pageerror", log.record_page_error)
        workspace = f"w{secrets.token_hex(4)}"
        page.goto(
            f"{demo.base_url}/lab/workspaces/{workspace}/tree/{notebook}?token={demo.token}",
            timeout=LOAD_TIMEOUT_MS,
        )
        lab = cls(page, log, demo, notebook, workspace)
        lab._wait_for_the_notebook()
        # The kernel is up and the first reading has arrived: the name says how many are free.
        expect(lab.button).to_have_attribute(
            "aria-label", re.compile(r"free$"), timeout=LOAD_TIMEOUT_MS
        )
        return lab

    def _wait_for_the_notebook(self) -> None:
        """Wait for JupyterLab to show the notebook, reloading the page once if it did not.

        A CI run under load once left JupyterLab's main area empty for the whole wait, with
        its menus drawn and no error on the page. JupyterLab's own start is not what these
        tests test, and a user would reload; what the first page showed is kept as a warning,
        and in the failure if the reloaded page shows no notebook either.
        """
        notebook = self.page.locator(NOTEBOOK_PANEL)
        try:
            expect(notebook).to_be_visible(timeout=LOAD_TIMEOUT_MS)
            return
        except AssertionError as e:
            first = f"{e}\n{self.log.text()}\n{self.demo.logs()}"
        warnings.warn(f"JupyterLab showed no notebook; reloading the page. {first}", stacklevel=1)
        self.page.reload(timeout=LOAD_TIMEOUT_MS)
        try:
            expect(notebook).to_be_visible(timeout=LOAD_TIMEOUT_MS)
        except AssertionError as e:
            raise AssertionError(f"{e}\nnor before the reload: {first}") from e

    def close(self) -> None:
        self.page.context.close()

    # --- what is on the page ---------------------------------------------------------------

    @property
    def button(self) -> Locator:
        return self.page.locator(BUTTON)

    @property
    def toolbar_item(self) -> Locator:
        return self.page.locator(TOOLBAR_ITEM)

    @property
    def menu(self) -> Locator:
        return self.page.locator(MENU)

    @property
    def status(self) -> Locator:
        return self.page.locator(STATUS)

    @property
    def summary(self) -> Locator:
        """The status bar item's visible text."""
        return self.page.locator(STATUS_TEXT)

    @property
    def panel(self) -> Locator:
        return self.page.locator(PANEL)

    def menu_item(self, label: str) -> Locator:
        """The menu's item whose label starts with ``label``."""
        starts = re.compile("^" + re.escape(label))
        return self.menu.locator(".lm-Menu-item").filter(
            has=self.page.locator(".lm-Menu-itemLabel", has_text=starts)
        )

    def toast(self, text: str | re.Pattern[str]) -> Locator:
        return self.page.locator(TOAST, has_text=text)

    def panel_gpu(self, uuid: str) -> Locator:
        """The panel's group (state, actions, charts) of the GPU ``uuid``."""
        return self.panel.locator(f"section[data-uuid='{uuid}']")

    # --- what the server says ----------------------------------------------------------------

    def kernel_id(self) -> str:
        sessions = self.demo.server.request("GET", "api/sessions").body
        [kernel_id] = [s["kernel"]["id"] for s in sessions if s["path"] == self.notebook]
        return str(kernel_id)

    def attached(self) -> list[dict[str, Any]]:
        """The kernel's GPUs as the REST API lists them (the test's reference)."""
        answer = self.demo.server.request(
            "GET", f"gpu-hotplug/api/gpus?kernel_id={self.kernel_id()}"
        )
        assert answer.status == 200, answer
        attached: list[dict[str, Any]] = answer.body["attached"]
        return attached

    # --- what the user does ------------------------------------------------------------------

    def choose(self, label: str) -> None:
        """Open the toolbar menu with the mouse and pick ``label``."""
        self.button.click()
        expect(self.menu).to_be_visible()
        self.menu_item(label).click()
        expect(self.menu).to_be_hidden()

    def confirm(self, button: str) -> Locator:
        """Press ``button`` in the open dialog; returns the dialog (gone afterwards)."""
        dialog = self.page.locator(DIALOG)
        expect(dialog).to_be_visible(timeout=SETTLE_MS)
        dialog.locator("button", has_text=button).click()
        expect(dialog).to_be_hidden(timeout=SETTLE_MS)
        return dialog

    def run_probe(self) -> str:
        """Run the notebook's cell; the list of device nodes it printed (as printed)."""
        prompt = self.page.locator(".jp-Cell .jp-InputPrompt").first
        before = prompt.inner_text()
        self.page.locator(".jp-Cell .jp-InputArea-editor").first.click()
        self.page.keyboard.press("Shift+Enter")
        # "[ ]:" or "[n]:" before, "[*]:" while it runs, "[n+1]:" when done.
        expect(prompt).not_to_have_text(before, timeout=SETTLE_MS)
        expect(prompt).to_have_text(re.compile(r"\[\d+\]"), timeout=SETTLE_MS)
        output = self.page.locator(".jp-Cell .jp-OutputArea-output").first
        match = _NODES.search(output.inner_text())
        assert match is not None, output.inner_text()
        return match[1]

    def cell_output(self, index: int) -> Locator:
        """The output area of the notebook's cell ``index`` (0: the probe)."""
        return self.page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea")

    def run_all(self) -> None:
        """Run every cell (JupyterLab's own command, from the palette) and wait until each
        has run."""
        self.palette("Run All Cells")
        prompts = self.page.locator(".jp-Notebook .jp-Cell .jp-InputPrompt")
        for i in range(prompts.count()):
            expect(prompts.nth(i)).to_have_text(re.compile(r"\[\d+\]"), timeout=SETTLE_MS)

    def palette(self, command: str) -> None:
        """Run ``command`` (its label) from the command palette, keyboard only."""
        # The first cell, not the notebook's middle: below a short notebook's last cell,
        # JupyterLab's footer takes a click for "add a cell".
        self.page.locator(".jp-Notebook .jp-Cell").first.click()
        self.page.keyboard.press("Escape")  # command mode: the notebook has the focus
        self.page.keyboard.press("Control+Shift+C")
        search = self.page.locator(".lm-CommandPalette-input")
        expect(search).to_be_focused(timeout=SETTLE_MS)
        search.fill(command)
        expect(
            self.page.locator(".lm-CommandPalette-item.lm-mod-active", has_text=command)
        ).to_be_visible(timeout=SETTLE_MS)
        self.page.keyboard.press("Enter")

    def open_panel(self) -> None:
        """With the keyboard shortcut (Alt+Shift+G)."""
        self.page.locator(".jp-Notebook").first.click()
        self.page.keyboard.press("Alt+Shift+G")
        expect(self.panel).to_be_visible(timeout=SETTLE_MS)

    def axe(self, *selectors: str) -> list[dict[str, Any]]:
        """axe-core's serious and critical violations within ``selectors``."""
        self.page.add_script_tag(path=str(AXE))
        result: dict[str, Any] = self.page.evaluate(
            "async (include) => await axe.run({include: include.map(s => [s])})",
            list(selectors),
        )
        return [
            {"id": v["id"], "impact": v["impact"], "nodes": [n["html"] for n in v["nodes"]]}
            for v in result["violations"]
            if v["impact"] in ("serious", "critical")
        ]
