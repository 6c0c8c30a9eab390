"""The starter notebook as shipped: valid, clean, and walking through what issue 6 asks."""

from __future__ import annotations

import nbformat

from jupyter_gpu_hotplug.demo.layout import starter_notebook_text


def load() -> nbformat.NotebookNode:
    notebook: nbformat.NotebookNode = nbformat.reads(  # type: ignore[no-untyped-call]
        starter_notebook_text(), as_version=4
    )
    return notebook


def test_it_is_a_valid_nbformat_4_notebook_with_a_kernelspec() -> None:
    notebook = load()
    nbformat.validate(notebook)
    assert notebook.nbformat == 4
    assert notebook.metadata.kernelspec.name == "python3"


def test_it_ships_without_outputs() -> None:
    code = [cell for cell in load().cells if cell.cell_type == "code"]
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code)


def test_the_walkthrough_comes_in_order() -> None:
    first_lines = [cell.source.split("\n")[0] for cell in load().cells if cell.cell_type == "code"]
    steps = [
        "%gpu status",
        "%gpu attach 1",
        "!ls -l /dev/nvidia*",
        "import pynvml",
        "%gpu load --seconds 300",
        "%gpu",
        "%gpu detach all --force",
    ]
    positions = [first_lines.index(step) for step in steps]
    assert positions == sorted(positions)


def test_it_keeps_the_gpu_busy_before_the_monitor() -> None:
    """A newcomer's first monitor shows a working GPU, not a flat 0 % (issue 36, item 1): the
    load helper starts from the magic (``!... &`` fails in a kernel), and the detach after it
    says why it needs ``--force``."""
    markdown = " ".join(c.source for c in load().cells if c.cell_type == "markdown")
    assert "`%gpu load` starts a small helper in the background" in markdown.replace("\n", " ")
    assert "a plain `%gpu detach all` would be refused" in markdown.replace("\n", " ")


def test_it_explains_the_cuda_caveat_and_restarts() -> None:
    text = " ".join(c.source for c in load().cells if c.cell_type == "markdown").replace("\n", " ")
    assert "already initialised CUDA" in text
    assert "attach *before* you import your GPU framework" in text
    assert "Restarting the kernel releases its GPUs" in text
    assert "SIMULATED GPUs" in text


def test_it_relies_on_the_demo_loading_the_magic_and_advertises_nothing_unbuilt() -> None:
    """The demo's kernels load ``%gpu`` themselves; there is no toolbar yet (issue 14)."""
    cells = load().cells
    assert not any("%load_ext" in c.source for c in cells if c.cell_type == "code")
    assert "already loaded" in cells[1].source
    assert not any("toolbar" in c.source.lower() for c in cells)
