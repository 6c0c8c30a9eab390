"""The hooks Jupyter discovers us by, and that they agree with the files shipped beside them.

Serving real requests after loading is covered by ``tests/server`` (``jp_fetch``); here we check
what ``jupyter server extension list``, ``jupyter labextension develop`` and ``%load_ext`` rely on.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from IPython.core.interactiveshell import InteractiveShell
from jupyter_server.extension.manager import ExtensionPackage

import jupyter_gpu_hotplug
from jupyter_gpu_hotplug.server.app import GPUHotplugApp

PACKAGE_DIR = Path(jupyter_gpu_hotplug.__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def test_server_extension_point_names_our_app() -> None:
    (point,) = jupyter_gpu_hotplug._jupyter_server_extension_points()

    module = importlib.import_module(point["module"])
    assert point["app"] is GPUHotplugApp
    assert module.GPUHotplugApp is GPUHotplugApp


def test_shipped_server_config_enables_the_app_by_its_name() -> None:
    config = PACKAGE_DIR / "etc" / "jupyter_server_config.d" / "jupyter_gpu_hotplug.json"

    assert _read_json(config) == {"ServerApp": {"jpserver_extensions": {GPUHotplugApp.name: True}}}


def test_jupyter_server_validates_the_package() -> None:
    # What `jupyter server extension list` does to report "OK".
    package = ExtensionPackage(name=GPUHotplugApp.name, enabled=True)  # type: ignore[no-untyped-call]

    assert package.validate()  # type: ignore[no-untyped-call]
    assert package.version == jupyter_gpu_hotplug.__version__
    assert list(package.extension_points) == [GPUHotplugApp.name]


def test_labextension_path_matches_the_frontend_build() -> None:
    (path,) = jupyter_gpu_hotplug._jupyter_labextension_paths()
    package_json = _read_json(REPO_ROOT / "labextension" / "package.json")
    install_json = _read_json(REPO_ROOT / "install.json")

    # The build writes to package.json's outputDir; src must name that directory.
    output_dir = (REPO_ROOT / "labextension" / package_json["jupyterlab"]["outputDir"]).resolve()
    assert output_dir == PACKAGE_DIR / path["src"]
    assert path["dest"] == package_json["name"] == install_json["packageName"]


def test_load_ipython_extension_registers_the_magic(ipython_shell: InteractiveShell) -> None:
    assert "gpu" not in ipython_shell.magics_manager.magics["line"]

    jupyter_gpu_hotplug.load_ipython_extension(ipython_shell)

    assert "gpu" in ipython_shell.magics_manager.magics["line"]
