"""How the package is layered, checked from its source: no import circle, and no import that runs up the layers.

The layers, lowest first (the one place they are written down). A module may import its own subpackage and any
lower layer, never a higher one nor a sibling on its own layer:

  1. settings, config, formats, costgrid   paths and defaults; checkpoint configs; engine manifests; cost grids
  2. models        the target and drafter modules (PyTorch), read from checkpoints
  3. runtime       the engine seam (runtime/base.py) and its implementations: PyTorch, ONNX Runtime, TensorRT(-LLM)
  4. decoding      the draft-and-verify loop, its policies, proposers and requests, on any engine
  5. loading       a decoder from checkpoints or built engines
  6. server, triton, train   the loop behind HTTP, behind Triton's python backend; drafter training
  7. sim, builders the loop on simulated engines (it drives the server's orchestrator); engine and repository builds
  8. plan          which draft length pays at which batch size: the simulator on a user's shapes and metrics
  9. bench         every benchmark: measured (in process, against servers) and simulated (bench/sim)
 10. cli           `dflash-trt`: the one command line; nothing imports it

Every import statement counts, wherever it stands: at the top, inside a function, or under `TYPE_CHECKING`. A
function-local import only postpones a circle (or an upward reach) to the first call, and a type-only one still
ties the two modules together for a reader and for mypy. The graph is read with `ast` (nothing is imported), so a
circle that would only break at run time in some import order is found all the same.

Also here: where things live. The package's one command line is `dflash-trt`; results/ holds output, no code;
scripts/ keeps only what a host runs without the package installed, a build step or a GPU recipe runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "dflash_trt"
REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / PACKAGE

LAYERS: tuple[tuple[str, ...], ...] = (
    ("settings", "config", "formats", "costgrid"),
    ("models",),
    ("runtime",),
    ("decoding",),
    ("loading",),
    ("server", "triton", "train"),
    ("sim", "builders"),
    ("plan",),
    ("bench",),
    ("cli",),
)


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


def layer_of(layers: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    """Subpackage (or top-level module) name -> its layer's index."""
    return {name: i for i, names in enumerate(layers) for name in names}


def upward_imports(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Every import of a module on a higher layer, or of a sibling on the same layer, as "a -> b"; a module whose
    subpackage no layer names is reported too (a new subpackage is placed on purpose)."""
    rank = layer_of(layers)
    found = []
    for module, imported in sorted(graph.items()):
        parts = module.split(".")
        if len(parts) == 1:  # the package's __init__
            continue
        if parts[1] not in rank:
            found.append(f"{module}: its subpackage {parts[1]!r} is on no layer")
            continue
        for other in sorted(imported):
            theirs = other.split(".")
            if len(theirs) == 1 or theirs[1] == parts[1]:
                continue
            if theirs[1] not in rank or rank[theirs[1]] >= rank[parts[1]]:
                found.append(f"{module} -> {other}")
    return found


def test_the_layer_check_sees_upward_and_sideways_imports(tmp_path: Path) -> None:
    """Negative control: an import up a layer (function-local), one sideways and one of an unplaced subpackage are
    reported; imports down the layers and within a subpackage are not."""
    pkg = tmp_path / "pkg"
    for sub in ("low", "mid_a", "mid_b", "high", "stray"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from . import b\ndef f():\n    from ..high import h\n")
    (pkg / "low" / "b.py").write_text("")
    (pkg / "mid_a" / "m.py").write_text("from ..low import a\nfrom ..mid_b import n\n")
    (pkg / "mid_b" / "n.py").write_text("import pkg.low.b\n")
    (pkg / "high" / "h.py").write_text("from pkg.mid_a import m\n")
    (pkg / "stray" / "s.py").write_text("")
    layers = (("low",), ("mid_a", "mid_b"), ("high",))
    assert upward_imports(import_graph(pkg), layers) == [
        "pkg.low.a -> pkg.high.h",
        "pkg.mid_a.m -> pkg.mid_b.n",
        "pkg.stray: its subpackage 'stray' is on no layer",
        "pkg.stray.s: its subpackage 'stray' is on no layer",
    ]


def test_no_import_runs_up_the_layers() -> None:
    found = upward_imports(import_graph(), LAYERS)
    assert found == [], "imports up (or across) the layers of this module's docstring:\n" + "\n".join(found)


def test_the_package_runs_as_one_command_line() -> None:
    """`dflash-trt` is the only command line: no module of the package is a program of its own, but for the one that
    runs where `dflash-trt` is not the entry point: the TensorRT-LLM checkpoint converter (run under mpirun by the
    target build, builders/trtllm_target.py)."""
    programs = sorted(
        m for m, path in module_names().items() if 'if __name__ == "__main__"' in path.read_text(encoding="utf-8")
    )
    assert programs == ["dflash_trt.builders.trtllm_convert", "dflash_trt.cli.main"]


def test_scripts_are_run_by_a_build_step_or_a_bare_host() -> None:
    """What stays in scripts/ is run by the Makefile, the Dockerfile, deploy/ or a GPU recipe in docs/ (a GPU host
    with only torch and transformers, a container build, vendoring, a training recipe): each is named there; a
    study or a benchmark belongs in the package, as a `dflash-trt` command."""
    runners = "".join(
        p.read_text(encoding="utf-8")
        for p in [REPO / "Makefile", REPO / "Dockerfile", *(REPO / "deploy").rglob("*"), *(REPO / "docs").glob("*.md")]
        if p.is_file() and p.suffix in ("", ".md", ".sh", ".yaml", ".txt")
    )
    scripts = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "scripts").rglob("*") if p.is_file())
    assert [s for s in scripts if s not in runners] == []
    assert all(s.count("/") == 1 for s in scripts), "no folders of scripts"


def test_results_holds_no_code() -> None:
    """results/ is output only: analysis code lives in the package (bench/) beside what it analyses."""
    assert sorted(str(p.relative_to(REPO)) for p in (REPO / "results").rglob("*.py")) == []
