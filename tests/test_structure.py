"""The structure report (``python -m tests.structure``) reads the code right, and the tree keeps
the limits issue 38 set: no function in ``agent/core`` over 60 lines, no import circle between
the modules of one package."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests import structure


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / structure.PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_a_circle_through_relative_imports_is_found_and_a_package_init_is_not_one(
    tmp_path: Path,
) -> None:
    top = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "from .a import A\nfrom .b import B\n",
            "core/a.py": "from .b import B\nA = 1\n",
            "core/b.py": "from . import c\nB = 2\n",
            "core/c.py": "from jupyter_gpu_hotplug.core.a import A\n",
            "other.py": "from .core import a\n",
        },
    )
    modules = structure.read_modules(top)
    assert modules[f"{structure.PACKAGE}.core.b"].imports == {f"{structure.PACKAGE}.core.c"}
    assert structure.circles(modules) == [
        [f"{structure.PACKAGE}.core.{m}" for m in ("a", "b", "c")]
    ]
    edges = structure.package_edges(modules, depth=2)
    assert edges == {(structure.PACKAGE, f"{structure.PACKAGE}.core"): 1}


def test_long_functions_are_counted_by_their_span(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(structure.LONG_FUNCTION))
    top = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/m.py": f"def long():\n{body}\n\nasync def short():\n    pass\n",
        },
    )
    (found,) = structure.long_functions(structure.read_modules(top), f"{structure.PACKAGE}.core")
    assert (found.name, found.lines) == ("long", structure.LONG_FUNCTION + 1)


def test_the_agent_core_has_no_function_over_sixty_lines() -> None:
    modules = structure.read_modules(structure.ROOT)
    long = structure.long_functions(modules, f"{structure.PACKAGE}.agent.core")
    assert [f"{f.module}:{f.name} ({f.lines})" for f in long] == []


def test_no_two_modules_of_one_package_import_each_other() -> None:
    assert structure.circles(structure.read_modules(structure.ROOT)) == []
