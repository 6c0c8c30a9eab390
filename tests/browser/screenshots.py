"""Take the README's and the usage page's screenshots of the GPU UI, light and dark.

Run as root from the repository root (it starts the demo, like the browser tests)::

    .venv/bin/python -m tests.browser.screenshots docs/images

For each theme: the toolbar menu, the GPU panel with live charts, the status bar and an error
notification ("no free GPU"), each cropped to the element, as ``gpu-<what>-<theme>.png``.
Not a test: it asserts nothing beyond reaching each state (the browser tests do that).
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import FloatRect, Locator, expect, sync_playwright

from tests.demo.conftest import DemoFactory
from tests.fixtures.browser import CHROMIUM, CHROMIUM_ARGS

from .gpu_lab import SETTLE_MS, GpuLab, quiet_lab

THEMES = {"light": "JupyterLab Light", "dark": "JupyterLab Dark"}
CHART_SECONDS = 20
"""Readings to collect before the panel is taken, so the charts show a line."""


def _union(page_locators: list[Locator], pad: int = 6) -> FloatRect:
    boxes = [box for locator in page_locators if (box := locator.bounding_box()) is not None]
    left = min(b["x"] for b in boxes) - pad
    top = min(b["y"] for b in boxes) - pad
    right = max(b["x"] + b["width"] for b in boxes) + pad
    bottom = max(b["y"] + b["height"] for b in boxes) + pad
    return FloatRect(x=max(0, left), y=max(0, top), width=right - left, height=bottom - top)


def take(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as playwright:
        factory = DemoFactory(Path(tmp))
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=list(CHROMIUM_ARGS), headless=True
        )
        try:
            demo = factory(simulate=2)
            for name, theme in THEMES.items():
                quiet_lab(demo.server, theme=theme)
                lab = GpuLab.open(browser, demo, f"screens-{name}.ipynb")
                page = lab.page
                lab.open_panel()
                lab.choose("Attach 1 GPU")
                expect(lab.toolbar_item).to_have_class(re.compile("jp-mod-gpus"), timeout=SETTLE_MS)
                time.sleep(CHART_SECONDS)  # the success notification closes itself meanwhile
                lab.panel.locator(".jp-GpuHotplug-panel-body").screenshot(
                    path=out / f"gpu-panel-{name}.png"
                )
                status = page.locator(".jp-StatusBar-Left")
                status.screenshot(path=out / f"gpu-statusbar-{name}.png")
                lab.button.click()
                expect(lab.menu).to_be_visible()
                page.screenshot(
                    path=out / f"gpu-toolbar-menu-{name}.png",
                    clip=_union([lab.menu, page.locator(".jp-NotebookPanel-toolbar")]),
                )
                page.keyboard.press("Escape")
                lab.choose("Attach 1 GPU")  # the last free one
                expect(lab.button).to_have_text("GPU \u00d72", timeout=SETTLE_MS)
                lab.palette("Attach GPUs to this kernel")
                error = page.locator(".Toastify__toast--error")
                expect(error).to_be_visible(timeout=SETTLE_MS)
                error.screenshot(path=out / f"gpu-error-{name}.png")
                demo.server.request(
                    "POST",
                    "gpu-hotplug/api/detach",
                    {"uuid": "all", "kernel_id": lab.kernel_id()},
                )
                lab.close()
        finally:
            browser.close()
            factory.close()


if __name__ == "__main__":
    take(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images"))
