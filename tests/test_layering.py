"""The package has no import circle: no module reaches itself through the imports it names.

Every import statement counts, wherever it stands: at the top, inside a function, or under `TYPE_CHECKING`. A
function-local import only postpones a circle to the first call, and a type-only one still ties the two modules
together for a reader and for mypy; both hide the layering the package means to have. The graph is read from the
source with `ast` (nothing is imported), so a circle that would only break at run time in some import order is
found all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "dflash_trt"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, a package standing for its __init__.py."""
    names: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules one import statement names: `from a import b` names a.b where b is a module of its
    own, else a (whose namespace b comes from)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if node.level:  # relative: level 1 is the module's own package
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = set()
    for alias in node.names:
        full = f"{source}.{alias.name}"
        found.add(full if full in known else source)
    return found & known


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports anywhere in its text."""
    names = module_names(root)
    known = set(names)
    graph: dict[str, set[str]] = {}
    for module, path in names.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _imported(node, module, path.name == "__init__.py", known)
        graph[module] = edges - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_finder_sees_circles_of_every_kind(tmp_path: Path) -> None:
    """Negative control: a top-level, a function-local and a type-only import each close a circle it reports."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import B\n")
    (pkg / "a.py").write_text("from .sub import B\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import f\nB = 1\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    (pkg / "e.py").write_text("from . import c\n")  # into a circle, not part of one
    found = circles(import_graph(pkg))
    assert sorted(found) == [["pkg.a", "pkg.sub", "pkg.sub.b"], ["pkg.c", "pkg.d"]]


def test_the_finder_reads_the_package() -> None:
    graph = import_graph()
    assert "dflash_trt.bench.runner" in graph["dflash_trt.cli.bench"]
    assert "dflash_trt.train.corpus" in graph["dflash_trt.train.prompts"]


@pytest.mark.parametrize("subpackage", ["bench", "train"])
def test_no_circle_in(subpackage: str) -> None:
    prefix = f"{PACKAGE}.{subpackage}"
    inside = [c for c in circles(import_graph()) if any(m == prefix or m.startswith(prefix + ".") for m in c)]
    assert inside == [], f"import circles in {prefix}: {inside}"


def test_the_package_has_no_import_circle() -> None:
    found = circles(import_graph())
    assert found == [], "import circles (each a set of modules that reach one another): " + "; ".join(
        " <-> ".join(c) for c in found
    )
