"""The decoding package's modules import one another one way: no circle, and none imports the loop (but the
package's front door), so the policy, the step's records, the chunk planner and the proposers stand below it."""

import ast
import re
from pathlib import Path

import dflash_trt.decoding

PACKAGE = Path(dflash_trt.decoding.__file__).parent
REPO = PACKAGE.parents[1]


def _imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports (type-checking imports included: a circle there is one too)."""
    graph = {}
    for path in PACKAGE.glob("*.py"):
        if path.stem == "__init__":
            continue
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found |= {a.name for a in node.names}
        graph[path.stem] = {m for m in found if (PACKAGE / f"{m}.py").exists()}
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path + [m, n]
            if n not in state and (found := visit(n, path + [m])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [])):
            return found
    return None


def test_no_decoding_module_imports_the_loop():
    graph = _imports()
    assert [m for m, deps in graph.items() if "loop" in deps] == []


def test_the_decoding_package_has_no_import_circle():
    assert _circle(_imports()) is None


def test_the_circle_finder_finds_one():  # negative control
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None


def test_one_name_per_idea_no_aliases_left() -> None:
    """Issue 55: the block bound is `StepRows.max_block` and `own_or_max` (their old names `cap` / `own_or_cap`
    are gone), and `BatchRow` comes from its home, decoding/row.py, not re-exported by the loop."""
    from dflash_trt.decoding import loop, policy, step

    assert not hasattr(step.StepRows, "cap") and not hasattr(policy, "own_or_cap")
    assert "BatchRow" not in loop.__all__
    sources = [*(REPO / "dflash_trt").rglob("*.py"), *(REPO / "tests").rglob("*.py")]
    from_loop = re.compile(r"(decoding\.loop|from \.loop) import [^\n]*\bBatchRow\b")
    importers = [p for p in sources if from_loop.search(p.read_text())]
    assert importers == []
