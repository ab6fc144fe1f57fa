"""Where the simulation's code lives (issue 56): its logic in the package, scripts thin over it, results/ output
only (no code there)."""

from __future__ import annotations

import ast
import re

from dflash_trt.settings import REPO_ROOT


def test_bench_sim_script_is_the_packages_command_line() -> None:
    """scripts/bench_sim.py defines nothing: its logic is dflash_trt/sim/bench (typed, linted, importable)."""
    tree = ast.parse((REPO_ROOT / "scripts" / "bench_sim.py").read_text())
    defined = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert defined == []
    imports = [n.module for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert "dflash_trt.sim.bench.cli" in imports


def test_results_holds_no_code() -> None:
    """Analysis scripts live in scripts/ (scripts/sim/ for the simulation's), beside the other scripts."""
    assert sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "results").rglob("*.py")) == []


def test_one_name_per_idea_no_aliases_left() -> None:
    """Issue 55: the block bound is `StepRows.max_block` and `own_or_max` (their old names `cap` / `own_or_cap`
    are gone), and `BatchRow` comes from its home, decoding/row.py, not re-exported by the loop."""
    from dflash_trt.decoding import loop, policy, step

    assert not hasattr(step.StepRows, "cap") and not hasattr(policy, "own_or_cap")
    assert "BatchRow" not in loop.__all__
    sources = [*(REPO_ROOT / "dflash_trt").rglob("*.py"), *(REPO_ROOT / "tests").rglob("*.py")]
    from_loop = re.compile(r"(decoding\.loop|from \.loop) import [^\n]*\bBatchRow\b")
    importers = [p for p in sources if from_loop.search(p.read_text())]
    assert importers == []
