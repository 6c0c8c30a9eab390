"""``image/build.sh --image notebook`` builds a user's notebook image for JupyterHub from this
tree with no registry, and it is what KubeSpawner runs (issue 34): ``jupyterhub-singleuser`` as
jovyan (uid 1000, gid 100) in a writable home, this project's server extension enabled and its
labextension installed in the venv, the kernel side and ``pynvml`` importable, and no NVIDIA
file at all (the node's agent brings the driver's at attach; glibc's ``ldconfig``, which that
injection runs in the container, is there). Its SBOM lists what it holds. Its size is printed;
nothing is timed.
"""

from __future__ import annotations

import re

import pytest

from jupyter_gpu_hotplug import __version__
from tests.fixtures.requirements import needs_root

from .hub_images import BUILD_TIMEOUT, BuiltImage, notebook_image
from .images import assert_the_sbom_lists_what_the_image_holds, inspect, run

# The images the real node runs: built in .ci/test's real-node lane, never in two lanes at once.
pytestmark = [
    *needs_root,
    pytest.mark.slow,
    pytest.mark.realnode,
    pytest.mark.timeout(BUILD_TIMEOUT + 300),
]


@pytest.fixture(scope="module")
def image() -> BuiltImage:
    return notebook_image()


def _plain(text: str) -> str:
    """Jupyter's listing without its colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_the_image_runs_jupyterhub_singleuser_as_jovyan(image: BuiltImage) -> None:
    inspected = inspect(image)
    print(f"\nnotebook image {image.name}: {inspected['Size'] / 2**20:.0f} MiB")
    assert image.archive.stat().st_size > 0
    config = inspected["Config"]
    assert config["Cmd"] == ["jupyterhub-singleuser"]
    assert (config["User"], config["WorkingDir"]) == ("1000:100", "/home/jovyan")
    found = run(
        image,
        "-c",
        "id -u; id -g; id -un; echo $HOME; touch $HOME/written && echo writable; "
        "command -v jupyterhub-singleuser",
        entrypoint="/bin/sh",
    )
    assert found.split() == [
        "1000",
        "100",
        "jovyan",
        "/home/jovyan",
        "writable",
        "/opt/notebook/bin/jupyterhub-singleuser",
    ]


def test_the_server_extension_is_enabled_and_the_labextension_installed(
    image: BuiltImage,
) -> None:
    servers = _plain(run(image, "-c", "jupyter server extension list 2>&1", entrypoint="/bin/sh"))
    assert re.search(r"^\s*jupyter_gpu_hotplug enabled$", servers, re.MULTILINE), servers
    assert f"jupyter_gpu_hotplug {__version__} OK" in servers
    labs = _plain(run(image, "-c", "jupyter labextension list 2>&1", entrypoint="/bin/sh"))
    assert re.search(
        rf"^\s*jupyter-gpu-hotplug v{re.escape(__version__)} enabled OK", labs, re.MULTILINE
    ), labs


def test_the_labs_site_settings_ask_no_user_about_jupyter_news(image: BuiltImage) -> None:
    """The overrides file is where JupyterLab reads site-wide settings (its application
    directory's ``settings``), so no user is asked to fetch news the pod cannot reach."""
    said = run(
        image,
        "-c",
        "import json\n"
        "from jupyterlab.labapp import LabApp\n"
        "with open(LabApp().app_settings_dir + '/overrides.json') as f:\n"
        "    print(json.load(f)['@jupyterlab/apputils-extension:notification']['fetchNews'])\n",
        entrypoint="python",
    )
    assert said.strip() == "false"


def test_the_kernel_side_imports_and_no_nvidia_file_is_there(image: BuiltImage) -> None:
    """pynvml imports but finds no library: the driver comes with the first attach."""
    said = run(
        image,
        "-c",
        "import jupyter_gpu_hotplug.kernel, pynvml\n"
        "try:\n    pynvml.nvmlInit()\n"
        "except pynvml.NVMLError_LibraryNotFound:\n    print('no libnvidia-ml')\n",
        entrypoint="python",
    )
    assert said.split("\n")[0] == "no libnvidia-ml"
    found = run(
        image,
        "-c",
        "command -v ldconfig; ldconfig -p | grep -i nvidia; "
        "find / -xdev \\( -name 'libnvidia*' -o -name 'libcuda*' -o -name 'nvidia-smi' \\) -print; "
        "ls /dev | grep -i nvidia; true",
        entrypoint="/bin/sh",
    )
    assert found.split() == ["/usr/sbin/ldconfig"]


def test_the_sbom_lists_what_the_image_holds(image: BuiltImage) -> None:
    assert_the_sbom_lists_what_the_image_holds(
        image, "/opt/notebook/bin/python", {"python3", "python3-venv", "libc6", "libc-bin"}
    )
