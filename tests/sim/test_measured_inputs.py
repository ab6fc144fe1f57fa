"""results/ is output only: no module under dflash_trt/ builds or reads a path under results/ (issue 56). The
measured inputs the code needs are read from data/measured/ (dflash_trt/sim/measured.py)."""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_trt.settings import REPO_ROOT

PACKAGE = REPO_ROOT / "dflash_trt"
RESULTS = REPO_ROOT / "results"


def _names_results(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split("/")[0] == "results"


def _output_default(call: ast.Call, kw: ast.keyword) -> bool:
    """`add_argument("--out", default="results/...")`: a folder the command writes, which results/ is for."""
    return (
        kw.arg == "default"
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "add_argument"
        and any(isinstance(a, ast.Constant) and a.value == "--out" for a in call.args)
    )


def results_paths(tree: ast.AST) -> Iterator[int]:
    """Line numbers where a path under results/ is made: a `/` operand, an argument of a call (Path(...),
    open(...)) or a keyword's value, except a command's --out default (written, not read). Words in
    docstrings, help and messages pass."""
    written = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for kw in node.keywords
        if _output_default(node, kw)
        for inner in ast.walk(kw.value)
    }
    for node in ast.walk(tree):
        if id(node) in written:
            continue
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            if _names_results(node.left) or _names_results(node.right):
                yield node.lineno
        elif isinstance(node, ast.Call):
            if any(_names_results(a) for a in node.args):
                yield node.lineno
            for kw in node.keywords:
                if kw.arg != "help" and _names_results(kw.value) and id(kw.value) not in written:
                    yield node.lineno


def test_no_module_builds_a_results_path() -> None:
    found = [
        f"{path.relative_to(REPO_ROOT)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in results_paths(ast.parse(path.read_text(), str(path)))
    ]
    assert found == [], f"paths under results/ in the package (results/ is output only): {found}"


def test_the_scan_finds_what_it_looks_for() -> None:
    """The rule above on code that breaks it and code that does not (the scan is not vacuous)."""
    bad = 'ROOT / "results" / "load"\nPath("results/parts/results.json")\nf(x, default="results/x.json")\n'
    ok = (
        '"""results/ in a docstring"""\np.add_argument("--out", default="results/bench", help="results/bench")\n'
        'p.add_argument("--out", type=Path, default=Path("results/bench"))\n'
    )
    assert sorted(results_paths(ast.parse(bad))) == [1, 2, 3]
    assert list(results_paths(ast.parse(ok))) == []


@pytest.fixture
def opened() -> Iterator[list[Path]]:
    """The files opened while the test runs (an audit hook: cannot be removed, so it records only while on)."""
    seen: list[Path] = []
    on = [True]

    def hook(event: str, args: tuple[object, ...]) -> None:
        if on[0] and event == "open" and isinstance(args[0], (str, Path)):
            seen.append(Path(args[0]).resolve())

    sys.addaudithook(hook)
    yield seen
    on[0] = False


def test_measured_inputs_are_read_from_data(opened: list[Path]) -> None:
    """The two readers of measured figures (the simulator's host term, the plan's demo acceptance) open files
    under data/measured/ and none under results/."""
    from dflash_trt.plan.inputs import demo_acceptance
    from dflash_trt.sim import serving

    curve = serving._host_curve.__wrapped__()  # type: ignore[attr-defined]  # functools.cache's undecorated
    demo = demo_acceptance()
    assert curve and demo.profiles
    under_results = [p for p in opened if p.is_relative_to(RESULTS.resolve())]
    assert under_results == []
    data = (REPO_ROOT / "data" / "measured").resolve()
    assert {p.name for p in opened if p.is_relative_to(data)} == {"host-step.json", "demo-load.json"}


def test_promote_copies_the_sections_the_code_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_trt.sim import measured

    target = tmp_path / "host-step.json"
    monkeypatch.setitem(measured.INPUTS, "host-step", (target, "bench-parts", ("sim_host",)))
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"sim_host": {"1": {"host_ms": 0.5}}, "engines": {"big": 1}}))
    assert measured.promote("host-step", results) == target
    doc = measured.read(target, "host-step")
    assert doc["sim_host"] == {"1": {"host_ms": 0.5}} and "engines" not in doc and "bench-parts" in doc["source"]
    results.write_text(json.dumps({"engines": {}}))
    with pytest.raises(ValueError, match="lacks sim_host"):
        measured.promote("host-step", results)
    target.unlink()
    with pytest.raises(FileNotFoundError, match="bench-parts"):  # names the benchmark that measures it
        measured.read(target, "host-step")
