"""End-to-end: JupyterLab loads in a real browser with our labextension and server extension.

Why it exists: unit tests on either side cannot show that the built frontend is installed
where JupyterLab looks, that its plugin activates without errors, or that it reaches the
server extension through the real ``base_url``, token and XSRF handling.
"""

from __future__ import annotations

import re

from playwright.sync_api import Page, expect

from jupyter_gpu_hotplug import __version__
from tests.fixtures.browser import LabServer, PageLog, StartLab, needs_chromium

pytestmark = needs_chromium

# Mirrors of labextension/src/constants.ts.
STATUS_PLUGIN_ID = "jupyter-gpu-hotplug:status-item"
STATUS_ITEM_SELECTOR = "#jp-gpu-hotplug-status"

APP_START_TIMEOUT_MS = 90_000
SETTLE_TIMEOUT_MS = 30_000


def _open_lab(page: Page, server: LabServer) -> None:
    """Load the page and wait until JupyterLab has activated its plugins and restored."""
    page.goto(server.lab_url, timeout=APP_START_TIMEOUT_MS)
    page.wait_for_function("() => window.jupyterapp !== undefined", timeout=APP_START_TIMEOUT_MS)
    page.evaluate("() => window.jupyterapp.restored")
    installed = page.evaluate("id => window.jupyterapp.hasPlugin(id)", STATUS_PLUGIN_ID)
    assert installed, (
        f"JupyterLab does not know {STATUS_PLUGIN_ID!r}: the labextension is not installed "
        "(run `pip install -e .` from the repository root)"
    )


def test_lab_activates_extension_and_shows_server_version(
    start_lab: StartLab, lab_page: tuple[Page, PageLog]
) -> None:
    server = start_lab()
    page, log = lab_page

    _open_lab(page, server)

    assert page.evaluate("id => window.jupyterapp.isPluginActivated(id)", STATUS_PLUGIN_ID)
    item = page.locator(STATUS_ITEM_SELECTOR)
    expect(item).to_have_text(f"GPU hot-plug v{__version__}", timeout=SETTLE_TIMEOUT_MS)
    expect(item).to_be_visible()
    assert log.errors_mentioning("gpu-hotplug", "gpu_hotplug") == [], server.log_tail()
    assert log.page_errors == []


def test_status_item_hides_when_server_extension_is_missing(
    start_lab: StartLab, lab_page: tuple[Page, PageLog]
) -> None:
    server = start_lab(server_extension=False)
    page, log = lab_page

    _open_lab(page, server)

    item = page.locator(STATUS_ITEM_SELECTOR)
    # The title carries the model's reason once the version request has failed.
    expect(item).to_have_attribute(
        "title", re.compile("not installed or not enabled"), timeout=SETTLE_TIMEOUT_MS
    )
    expect(item).to_be_hidden()
    expect(item).to_have_text("")
    assert page.evaluate("id => window.jupyterapp.isPluginActivated(id)", STATUS_PLUGIN_ID)
    assert log.page_errors == []
