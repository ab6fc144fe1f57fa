"""A target without a DFlash drafter (`--drafter none`, or any target but the demo's with no `--drafter`): `generate`
drafts with the suffix and ngram proposers, which need no model, and its greedy output is the target alone's token
for token; a proposer that uses the drafter is refused with a clear error. On the demo target and on a real model
that does not loop (SmolLM2-135M-Instruct from `make models`), through the command line's own entry point."""

from __future__ import annotations

import json

import pytest

from dflash_trt.cli import main
from dflash_trt.models.pretrained import CHECKSUM_FILE, MODELS_DIR, SMOLLM2_135M
from dflash_trt.settings import DEMO_TARGET

# text that repeats, so that suffix and ngram drafts fire: a rewrite of a function given its earlier version
PROMPT = "def add(a, b):\n    total = a + b\n    return total\n\n\ndef add(a, b):\n"
SMOLLM2 = MODELS_DIR / SMOLLM2_135M.name


def _generate(capsys, target, *args) -> tuple[dict, str]:
    code = main(["generate", "--target", str(target), "--prompt", PROMPT, "--max-new-tokens", "24", "--json", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out), out.err


def _targets() -> list:
    demo = pytest.param(DEMO_TARGET, id="demo", marks=[] if DEMO_TARGET.is_dir() else pytest.mark.skip("no demo"))
    ready = (SMOLLM2 / CHECKSUM_FILE).is_file()
    smol = pytest.param(SMOLLM2, id="smollm2", marks=[] if ready else pytest.mark.skip("run `make models` first"))
    return [demo, smol]


@pytest.mark.parametrize("target", _targets())
def test_suffix_and_ngram_drafts_without_a_drafter_give_the_target_alones_output(capsys, target):
    alone, _ = _generate(capsys, target, "--no-draft", "--proposer", "suffix")  # --no-draft: no proposer drafts
    assert alone["stats"]["drafted_tokens"] == 0 and alone["drafter_dtype"] is None
    for proposer in ("suffix", "ngram"):
        got, _ = _generate(capsys, target, "--drafter", "none", "--proposer", proposer)
        assert got["token_ids"] == alone["token_ids"], proposer
        assert got["drafter_dtype"] is None and got["stats"]["proposer"] == proposer
        assert got["stats"]["drafted_by"].get(proposer, 0) > 0, f"{proposer} drafted nothing on repeated text"


@pytest.mark.skipif(not (SMOLLM2 / CHECKSUM_FILE).is_file(), reason="run `make models` first")
def test_a_target_given_without_a_drafter_loads_none_and_drafts_suffix_runs(capsys):
    """The demo drafter fits the demo target only: next to SmolLM2 it stopped on its hidden size. With no
    --drafter, another target loads no drafter (said on stderr) and drafts with the suffix proposer."""
    got, err = _generate(capsys, SMOLLM2)
    assert got["drafter_dtype"] is None and got["stats"]["proposer"] == "suffix"
    assert "no --drafter" in err


@pytest.mark.skipif(not DEMO_TARGET.is_dir(), reason="no demo models")
@pytest.mark.parametrize("proposer", ["dflash", "hybrid"])
def test_a_proposer_that_needs_the_drafter_is_refused_without_one(capsys, proposer):
    code = main(
        ["generate", "--target", str(DEMO_TARGET), "--drafter", "none", "--proposer", proposer, "--prompt", "x"]
    )
    err = capsys.readouterr().err
    assert code == 1 and f"--proposer {proposer} drafts with a DFlash drafter and none is loaded" in err
    assert "suffix" in err and "ngram" in err


@pytest.mark.skipif(not DEMO_TARGET.is_dir(), reason="no demo models")
def test_the_demo_target_still_gets_the_demo_drafter_by_default(capsys):
    got, _ = _generate(capsys, DEMO_TARGET)
    assert got["drafter_dtype"] is not None and got["stats"]["proposer"] == "dflash"


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (["plan"], "the plan chooses DFlash draft lengths"),
        (["triton-repo"], "BLS loop drafts with the DFlash drafter"),
        (["bench"], "leave dflash-torch and dflash-ort out of --methods"),
    ],
)
def test_commands_that_need_a_drafter_refuse_none_and_say_what_to_use(capsys, tmp_path, command, said):
    assert main([*command, "--drafter", "none", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
