"""The `dflash-trt generate` contract: JSON output, equality with --no-draft, clean error exits."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_text_models
from transformers import AutoModelForCausalLM

from dflash_trt.cli import main

CLI = Path(sys.executable).parent / "dflash-trt"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    make_text_models(root)
    bare = root / "bare"  # a target without a tokenizer
    AutoModelForCausalLM.from_pretrained(root / "target").save_pretrained(bare)
    return root / "target", root / "drafter", bare


def run_cli(*args):
    proc = subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_console_script_json_contract(models):
    target, drafter, _ = models
    code, out, err = run_cli(
        "generate",
        "--target",
        target,
        "--drafter",
        drafter,
        "--prompt",
        "def fibonacci(n):",
        "--max-new-tokens",
        "12",
        "--json",
    )
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert isinstance(data["text"], str)
    assert len(data["token_ids"]) <= 12 and all(isinstance(t, int) for t in data["token_ids"])
    stats = data["stats"]
    for key, kind in [
        ("rounds", int),
        ("acceptance_lengths", list),
        ("mean_acceptance_length", float),
        ("new_tokens", int),
        ("tokens_per_second", float),
        ("draft_time_s", float),
        ("verify_time_s", float),
    ]:
        assert isinstance(stats[key], kind), key
    assert stats["new_tokens"] == len(data["token_ids"])
    assert sum(stats["acceptance_lengths"]) == stats["new_tokens"] - 1


def generate_json(capsys, *args) -> dict:
    assert main(["generate", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_draft_and_no_draft_agree(models, capsys):
    target, drafter, bare = models
    spec = generate_json(
        capsys, "--target", target, "--drafter", drafter, "--input-ids", "5,6,7", "--max-new-tokens", 20
    )
    alone = generate_json(capsys, "--target", target, "--input-ids", "5,6,7", "--max-new-tokens", 20, "--no-draft")
    assert spec["token_ids"] == alone["token_ids"]
    assert alone["stats"]["drafted_tokens"] == 0 and spec["stats"]["drafted_tokens"] > 0
    # a target without a tokenizer works with ids; text is null
    no_tok = generate_json(
        capsys, "--target", bare, "--drafter", drafter, "--input-ids", "5,6,7", "--max-new-tokens", 5
    )
    assert no_tok["text"] is None and len(no_tok["token_ids"]) == 5


def test_trace_holds_each_rounds_drafts_and_acceptance(models, capsys):
    """Greedy: each round commits its first `accepted` drafts, then the target's own token, which differs
    from the next draft (the one it rejected); misaligned or missing drafts fail this. The demo pair, whose
    drafter is trained, so rounds both accept and reject."""
    prompt = 'def mean(values):\n    """Return the arithmetic mean of a list of numbers."""\n'
    out = generate_json(capsys, "--prompt", prompt, "--max-new-tokens", 48, "--trace")
    trace, ids = out["trace"], out["token_ids"]
    assert len(trace) == out["stats"]["rounds"] > 0
    assert [r["accepted"] + 1 for r in trace][:-1] == out["stats"]["acceptance_lengths"][:-1]
    assert any(r["accepted"] > 0 for r in trace) and any(r["accepted"] < r["block_size"] - 1 for r in trace)
    pos = 1  # ids[0] is the prefill's token
    for r in trace[:-1]:  # the last round may be cut by the token budget
        drafted, n = r["drafted"], r["accepted"]
        assert len(drafted) == r["block_size"] - 1 and 0 <= n <= len(drafted)
        assert ids[pos : pos + n] == drafted[:n]
        if n < len(drafted):
            assert ids[pos + n] != drafted[n]
        pos += n + 1
    target, drafter, _ = models
    assert "trace" not in generate_json(
        capsys, "--target", target, "--drafter", drafter, "--input-ids", "5,6,7", "--max-new-tokens", 4
    )


def test_a_trace_with_drafts_missing_for_some_rounds_is_refused():
    """The loop records the drafted ids, `commit` the counts: a path recording one without the other must not
    pair drafts with another round's acceptance."""
    from dflash_trt.decoding.request import GenerationStats

    stats = GenerationStats(drafted_ids_per_round=[[4, 5]], accepted_per_round=[1, 0])
    with pytest.raises(RuntimeError, match="1 rounds' drafted ids for 2 rounds' acceptance"):
        stats.trace()
    stats.drafted_ids_per_round.append([])
    assert stats.trace() == [
        {"block_size": 3, "drafted": [4, 5], "accepted": 1},
        {"block_size": 1, "drafted": [], "accepted": 0},
    ]


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--target", "/nonexistent/model", "--input-ids", "1"], 1, "target directory not found"),
        (["--drafter", "/nonexistent/d", "--input-ids", "1"], 1, "drafter directory not found"),
        (["--input-ids", "1,2,99999"], 1, "out of vocabulary"),
        (["--input-ids", "1,x"], 2, "comma-separated integers"),
        (["--input-ids", "1", "--temperature", "abc"], 2, "expected a number"),
        (["--input-ids", "1", "--max-new-tokens", "0"], 2, "must be >= 1"),
        (["--input-ids", "1", "--top-p", "0", "--temperature", "1"], 1, "top_p"),
        (["--input-ids", "1", "--temperature", "-1"], 1, "temperature"),
        (["--input-ids", "1", "--block-size", "64"], 1, "block_size"),
        (["--input-ids", "1", "--max-new-tokens", "5000"], 1, "context length"),
        (["--input-ids", "1", "--trace"], 1, "pass --json too"),
    ],
)
def test_errors_exit_non_zero_with_one_line(models, capsys, args, code, message):
    target, drafter, _ = models
    full = ["generate", "--target", str(target), "--drafter", str(drafter), *args]
    try:
        got = main(full)
    except SystemExit as e:  # argparse usage errors
        got = e.code
    err = capsys.readouterr().err
    assert got == code
    assert message in err and "Traceback" not in err
    assert len([line for line in err.strip().splitlines() if "error" in line]) == 1


def test_prompt_without_tokenizer_is_a_clear_error(models, capsys):
    _, drafter, bare = models
    assert main(["generate", "--target", str(bare), "--drafter", str(drafter), "--prompt", "hi"]) == 1
    assert "no tokenizer" in capsys.readouterr().err


def test_help_explains_every_flag():
    code, out, _ = run_cli("generate", "--help")
    assert code == 0
    for flag in (
        "--target",
        "--drafter",
        "--prompt",
        "--input-ids",
        "--max-new-tokens",
        "--temperature",
        "--top-p",
        "--top-k",
        "--seed",
        "--block-size",
        "--no-draft",
        "--json",
        "--trace",
    ):
        assert flag in out


def test_proposer_flag_and_its_trace(models, capsys):
    """`--proposer`: each proposer's greedy tokens are the target's own; the trace says each round's proposer."""
    from dflash_trt.decoding.proposers import PROPOSERS, proposer_for

    target, drafter, _ = models
    args = ("--target", target, "--drafter", drafter, "--input-ids", "5,6,7,8,5,6,7,8,5,6", "--max-new-tokens", 12)
    base = generate_json(capsys, *args, "--no-draft")["token_ids"]
    for proposer in PROPOSERS:
        out = generate_json(capsys, *args, "--proposer", proposer, "--trace")
        assert out["token_ids"] == base and out["stats"]["proposer"] == proposer
        assert {r["proposer"] for r in out["trace"]} <= {*PROPOSERS, "none"}
        if not proposer_for(proposer).uses_drafter:
            assert "dflash" not in {r["proposer"] for r in out["trace"]}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name (argparse keeps them in its subparsers action's choices)."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def test_one_command_line_runs_every_benchmark_and_each_explains_itself():
    """The benchmarks, the evaluation, the plan's load check and the model fetch are `dflash-trt` commands (no other command line):
    each has a description and every flag a help line; `dflash-trt bench` without an action is the method
    comparison it always was."""
    from dflash_trt.cli.bench import cmd_bench
    from dflash_trt.cli.main import build_parser

    parser = build_parser()
    top = _subcommands(parser)
    bench, plan = _subcommands(top["bench"]), _subcommands(top["plan"])
    assert {"sim", "load", "serve", "soak", "parts", "proposers", "prefill", "session", "suffix-trace"} <= set(bench)
    assert "measured-inputs" in bench and "check-load" in plan and "eval" in top
    fetch = _subcommands(top["models"])["fetch"]
    for name, sub in [
        *bench.items(),
        ("plan check-load", plan["check-load"]),
        ("eval", top["eval"]),
        ("models fetch", fetch),
    ]:
        assert sub.description and len(sub.description) > 80, name
        undocumented = [a.dest for a in sub._actions if not a.help and a.dest != "help"]
        assert undocumented == [], f"{name}: flags without help: {undocumented}"
    args = parser.parse_args(["bench", "--out", "x", "--repeats", "2"])
    assert args.func is cmd_bench and args.bench_action is None and args.repeats == 2


def test_a_bench_action_runs_on_its_own_arguments_only():
    """An action records its settings and hands its arguments to worker processes: it gets its own flags, not
    `dflash-trt bench`'s defaults beside them nor the parser (which does not pickle)."""
    import pickle

    from dflash_trt.cli.bench import _own_arguments

    bench = argparse.ArgumentParser()
    bench.add_argument("--methods", default=["all"])
    action = bench.add_subparsers(dest="action").add_parser("sim")
    action.add_argument("--smoke", action="store_true")
    seen = []
    action.set_defaults(func=_own_arguments(action, lambda a: seen.append(a) or 0))
    args = bench.parse_args(["sim", "--smoke"])
    assert args.methods == ["all"] and args.func(args) == 0
    assert vars(seen[0]) == {"smoke": True}
    assert pickle.loads(pickle.dumps(seen[0])).smoke is True


def test_help_loads_no_model_library():
    """`dflash-trt --help` builds every command's parser, the benchmarks' included: none of them may load
    transformers (seconds) for it; a module that needs it imports it where it runs."""
    code = (
        "import sys; from dflash_trt.cli.main import build_parser; build_parser(); print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "False"
