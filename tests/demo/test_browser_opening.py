"""Opening the browser: only where there is a display, and never silently failing."""

from __future__ import annotations

from jupyter_gpu_hotplug.demo.runner import open_browser

URL = "http://127.0.0.1:8888/lab/tree/gpu-hotplug-starter.ipynb?token=t"


def test_without_a_display_no_browser_is_started() -> None:
    opened: list[str] = []

    def opener(url: str) -> bool:
        opened.append(url)
        return True

    message = open_browser(URL, environ={}, opener=opener)
    assert message == "no graphical display here: open the URL above in your browser"
    assert opened == []


def test_with_a_display_the_starter_notebook_is_opened() -> None:
    opened: list[str] = []

    def opener(url: str) -> bool:
        opened.append(url)
        return True

    assert open_browser(URL, environ={"WAYLAND_DISPLAY": "wayland-0"}, opener=opener) is None
    assert opened == [URL]


def test_a_browser_that_cannot_be_started_is_reported() -> None:
    message = open_browser(URL, environ={"DISPLAY": ":0"}, opener=lambda url: False)
    assert message == "could not open a browser: open the URL above yourself"
