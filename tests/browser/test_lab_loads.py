"""End-to-end: JupyterLab loads in a real browser with our labextension and server extension.

Why it exists: unit tests on either side cannot show that the built frontend is installed
where JupyterLab looks, that its plugin activates without errors, or that it reaches the
server extension through the real ``base_url``, token and XSRF handling.
"""

from __future__ import annotations

from playwright.sync_api import Page, expect

from jupyter_gpu_hotplug import __version__
from tests.fixtures.browser import LabServer, PageLog, StartLab, needs_chromium

pytestmark = needs_chromium

# Mirrors of labextension/src/constants.ts.
PLUGIN_ID = "jupyter-gpu-hotplug:plugin"
PANEL_TAB = ".lm-TabBar-tab[data-id='jp-gpu-hotplug-panel']"

APP_START_TIMEOUT_MS = 90_000
SETTLE_TIMEOUT_MS = 30_000


def _open_lab(page: Page, server: LabServer) -> None:
    """Load the page and wait until JupyterLab has activated its plugins and restored."""
    page.goto(server.lab_url, timeout=APP_START_TIMEOUT_MS)
    page.wait_for_function("() => window.jupyterapp !== undefined", timeout=APP_START_TIMEOUT_MS)
    page.evaluate("() => window.jupyterapp.restored")
    installed = page.evaluate("id => window.jupyterapp.hasPlugin(id)", PLUGIN_ID)
    assert installed, (
        f"JupyterLab does not know {PLUGIN_ID!r}: the labextension is not installed "
        "(run `pip install -e .` from the repository root)"
    )


def test_lab_activates_extension_and_reaches_the_server_extension(
    start_lab: StartLab, lab_page: tuple[Page, PageLog]
) -> None:
    server = start_lab()
    page, log = lab_page

    _open_lab(page, server)

    assert page.evaluate("id => window.jupyterapp.isPluginActivated(id)", PLUGIN_ID)
    expect(page.locator(PANEL_TAB)).to_be_visible(timeout=SETTLE_TIMEOUT_MS)
    version = page.evaluate(
        """async () => {
            const base = document.querySelector('#jupyter-config-data');
            const config = JSON.parse(base.textContent);
            const answer = await fetch(config.baseUrl + 'gpu-hotplug/api/version',
                {headers: {Authorization: 'token ' + config.token}});
            return (await answer.json()).version;
        }"""
    )
    assert version == __version__
    assert log.errors_mentioning("gpu-hotplug", "gpu_hotplug") == [], server.log_tail()
    assert log.page_errors == []


def test_extension_activates_quietly_when_server_extension_is_missing(
    start_lab: StartLab, lab_page: tuple[Page, PageLog]
) -> None:
    server = start_lab(server_extension=False)
    page, log = lab_page

    _open_lab(page, server)

    assert page.evaluate("id => window.jupyterapp.isPluginActivated(id)", PLUGIN_ID)
    expect(page.locator("#jp-gpu-hotplug-gpus-status")).to_be_hidden()
    assert log.page_errors == []
