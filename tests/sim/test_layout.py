"""Where the simulation's code lives (issue 56): its logic in the package, scripts thin over it, results/ output
only (no code there)."""

from __future__ import annotations

import ast

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
