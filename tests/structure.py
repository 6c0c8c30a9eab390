"""The code's structure in figures, for this tree or any commit: ``python -m tests.structure``.

Why it exists: a redesign is argued with its before and after (issue 38: "show the structure
before and after with a command anyone can run"), and the figures that matter to a reviewer —
how big each package and module is, which functions outgrew a screen, which modules import
each other in a circle, which packages lean on which — are read from the code itself, with the
standard library only, so the same command runs on a checkout of an old commit
(``--rev c934cfa`` exports it with ``git archive`` first).

The figures are the code's, never a judgement; ``tests/test_structure.py`` holds the current
tree to the limits the project keeps (no function in ``agent/core`` over 60 lines, no import
circle inside a package).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

PACKAGE = "jupyter_gpu_hotplug"
ROOT = Path(__file__).parents[1]
LONG_FUNCTION = 60


@dataclass(frozen=True)
class Function:
    """One function or method and how many lines it spans (decorators excluded)."""

    module: str
    name: str
    lines: int


@dataclass(frozen=True)
class Module:
    """One module of the package: its dotted name, size, functions and what of ours it imports."""

    name: str
    lines: int
    functions: tuple[Function, ...]
    imports: frozenset[str]
    is_package: bool

    @property
    def package(self) -> str:
        """The package the module's code belongs to: its own name for a package's
        ``__init__``, else its parent's (``a.b`` for ``a.b.c``)."""
        return self.name if self.is_package else self.parent

    @property
    def parent(self) -> str:
        """The package that contains the module (``a.b`` for ``a.b.c``, module or package)."""
        return self.name.rpartition(".")[0]


def _dotted(path: Path, top: Path) -> str:
    parts = list(path.relative_to(top).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(tree: ast.Module, name: str, *, is_package: bool, names: set[str]) -> Iterator[str]:
    """The modules of ours that ``tree`` imports (``names``: every module of the package),
    relative imports resolved; ``from x import y`` counts ``x.y`` when ``y`` is a module and
    ``x`` otherwise. Imports under ``if TYPE_CHECKING:`` count too: a circle of types is
    still a circle a reader has to hold in mind."""
    here = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name in names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            for alias in node.names:
                sub = f"{stem}.{alias.name}"
                if sub in names:
                    yield sub
                elif stem in names:
                    yield stem


def read_modules(top: Path) -> dict[str, Module]:
    """Every module under ``top/jupyter_gpu_hotplug``, keyed by dotted name."""
    paths = sorted((top / PACKAGE).rglob("*.py"))
    names = {_dotted(path, top) for path in paths}
    modules: dict[str, Module] = {}
    for path in paths:
        name = _dotted(path, top)
        text = path.read_text()
        tree = ast.parse(text)
        functions = tuple(
            Function(name, node.name, node.end_lineno - node.lineno + 1)
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno is not None
        )
        is_package = path.name == "__init__.py"
        imported = _imported(tree, name, is_package=is_package, names=names)
        imports = frozenset(i for i in imported if i in names and i != name)
        modules[name] = Module(name, len(text.splitlines()), functions, imports, is_package)
    return modules


def long_functions(modules: dict[str, Module], under: str) -> list[Function]:
    """Functions over ``LONG_FUNCTION`` lines in the modules under the package ``under``."""
    return sorted(
        (
            f
            for m in modules.values()
            if m.name.startswith(under + ".")
            for f in m.functions
            if f.lines > LONG_FUNCTION
        ),
        key=lambda f: -f.lines,
    )


def circles(modules: dict[str, Module]) -> list[list[str]]:
    """Import circles between sibling modules (strongly connected sets of two or more, each
    within one package; Tarjan's algorithm). A package's ``__init__`` re-exporting its
    modules is not a circle of its modules."""
    graph = {
        name: [i for i in m.imports if modules[i].parent == m.parent and not m.is_package]
        for name, m in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in graph:
        if node not in index:
            visit(node)
    return sorted(found)


def package_edges(modules: dict[str, Module], depth: int) -> Counter[tuple[str, str]]:
    """How many module-level imports go from each package to each other one, packages cut
    to ``depth`` dotted parts (2: ``jupyter_gpu_hotplug.agent``)."""

    def cut(module: Module) -> str:
        return ".".join(module.package.split(".")[:depth])

    edges: Counter[tuple[str, str]] = Counter()
    for m in modules.values():
        for target in m.imports:
            a, b = cut(m), cut(modules[target])
            if a != b:
                edges[(a, b)] += 1
    return edges


def report(modules: dict[str, Module], *, focus: str, depth: int) -> str:
    """The figures as text: sizes per package, the largest modules, long functions and
    circles under ``focus``, and the package-to-package imports."""
    sizes: dict[str, int] = defaultdict(int)
    counts: Counter[str] = Counter()
    for m in modules.values():
        sizes[m.package] += m.lines
        counts[m.package] += 1
    out = ["## lines per package (modules)"]
    out += [f"{sizes[p]:>7}  {p} ({counts[p]})" for p in sorted(sizes)]
    in_focus = sorted(
        (m for m in modules.values() if m.name.startswith(focus)), key=lambda m: -m.lines
    )
    out += ["", f"## the ten largest modules under {focus}"]
    out += [f"{m.lines:>7}  {m.name}" for m in in_focus[:10]]
    long = long_functions(modules, focus)
    out += ["", f"## functions over {LONG_FUNCTION} lines under {focus}: {len(long)}"]
    out += [f"{f.lines:>7}  {f.module}:{f.name}" for f in long]
    found = [c for c in circles(modules) if c[0].startswith(focus)]
    out += ["", f"## import circles under {focus}: {len(found)}"]
    out += ["         " + " <-> ".join(c) for c in found]
    out += ["", f"## imports between packages (depth {depth})"]
    out += [f"{n:>7}  {a} -> {b}" for (a, b), n in sorted(package_edges(modules, depth).items())]
    return "\n".join(out) + "\n"


def _export(rev: str, into: Path) -> Path:
    """The package as it was at ``rev``, unpacked under ``into`` (``git archive``)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, PACKAGE], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def main(argv: list[str] | None = None) -> int:
    """Print the report for the working tree, or for ``--rev``."""
    parser = argparse.ArgumentParser(prog="python -m tests.structure", description=__doc__)
    parser.add_argument("--rev", help="a commit to report on instead of the working tree")
    parser.add_argument("--focus", default=f"{PACKAGE}.agent.core", help="package to detail")
    parser.add_argument("--depth", type=int, default=3, help="package depth of the import table")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        top = _export(args.rev, Path(tmp)) if args.rev else ROOT
        sys.stdout.write(report(read_modules(top), focus=args.focus, depth=args.depth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
