"""The code check of the quality evaluation: what counts as a body that parses with real statements."""

from dflash_trt.bench.prompts import held_out_function_prompts
from dflash_trt.bench.quality import check_body
from dflash_trt.train.data import stdlib_files

HEAD = 'def area(w, h):\n    """Area of a w x h rectangle."""'


def test_a_real_body_that_ends_counts():
    c = check_body(HEAD, "\n    if w < 0:\n        raise ValueError(w)\n    return w * h\n\n\ndef other():\n    pass\n")
    assert c.parses and c.ended and c.statements == 3 and c.is_code  # if, raise (nested), return


def test_comments_pass_and_constants_are_not_statements():
    assert check_body(HEAD, "\n    # the file is a file\n    # is a file\n    pass\n    ...\n    'x'\n").statements == 0
    assert not check_body(HEAD, "\n    return w * h\n").is_code  # one statement is not a body


def test_python_must_accept_it_and_drifting_into_methods_is_not_a_body():
    assert not check_body("def f(a, a):\n    'x'", "\n    return a\n    return a\n").parses  # duplicate argument
    methods = "\n\n    def __init__(self, name):\n        self.name = name\n        return None\n"
    assert check_body(HEAD, methods).statements == 1  # the nested def, not its body
    loop = "\n    for i in w:\n        try:\n            h += i\n        except E:\n            h = 0\n"
    assert check_body(HEAD, loop).statements == 4  # for, try, the assignment and the handler's


def test_a_function_that_ended_must_parse_whole():
    c = check_body(HEAD, "\n    x = w *\n    return x\nprint(1)\n")
    assert not c.parses and c.ended and not c.is_code


def test_a_body_cut_by_the_token_limit_is_judged_on_what_parses():
    c = check_body(HEAD, "\n    x = w * h\n    y = x + 1\n    return foo(x,")
    assert c.parses and not c.ended and c.statements == 2 and c.is_code
    assert check_body(HEAD, "\n  x = (").statements == 0  # cut back to the docstring alone: no body
    # only the last statement may go: garbage before it is not cut away
    assert not check_body(HEAD, "\n    x = 1\n    y = 2\n    )(\n    z = 3\n    return f(").parses
    # a comment at column 0 does not end the function
    assert check_body(HEAD, "\n    x = 1\n# note\n    return x\n\nprint(2)\n").statements == 2


def test_function_prompts_are_held_out_heads_that_end_at_the_docstring():
    held = {p.name for p in stdlib_files("held-out")}
    prompts = held_out_function_prompts(12)
    assert len({p.source for p in prompts}) == 12
    for p in prompts:
        assert p.source.split(":")[0].rsplit("/", 1)[-1] in held
        assert p.text.startswith(("def ", "async def ", "@")) and p.text.endswith(('"', "'"))
        assert check_body(p.text, "\n    pass\n").parses  # the head is a whole function once a body follows
        assert check_body(p.text, p.body).is_code, p.source  # the library's own body passes the check


def test_the_evaluation_script_reports_code_bodies_next_to_tau_and_speedup(tmp_path):
    """`dflash-trt eval --prompt-set functions`, the server's defaults, on the tiny text pair: every
    output identical to the target alone, and each prompt's completion judged as code."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from helpers import make_text_models

    target, drafter = make_text_models(tmp_path)
    out = tmp_path / "quality.json"
    cmd = [sys.executable, "-m", "dflash_trt.cli", "eval", "--target", target, "--drafter", drafter]
    cmd += ["--prompt-set", "functions", "--prompts", "3", "--max-new-tokens", "12", "--server-defaults"]
    done = subprocess.run(
        [*map(str, cmd), "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2]
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    summary, rows = report["summary"], report["per_prompt"]
    assert summary["all_identical"] and summary["server_defaults"] and summary["block_size"] == "adaptive"
    assert len(rows) == 3 and all(r["kind"] == "function" and "completion" in r for r in rows)
    assert summary["code_bodies"] == sum(r["is_code"] for r in rows) / 3
    assert "code body" in done.stdout and "code bodies" in done.stdout
