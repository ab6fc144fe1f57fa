"""Checkpoints and tokenizers this project writes load under transformers 4.57.x (TensorRT-LLM 1.2 pins 4.57.1) and
5.x. Part of the main suite and of the transformers 4.57.1 leg (`make test-tf457`, venv .venv-tf457)."""

import json
import os
from pathlib import Path

import pytest
import transformers
from helpers import make_tokenizer
from transformers import AutoConfig, AutoTokenizer

from dflash_trt.cli import main
from dflash_trt.models.target import PORTABLE_TOKENIZER_CLASS, make_portable
from dflash_trt.settings import DEMO_DIR

MODELS = Path(DEMO_DIR)


def test_running_under_the_expected_transformers():
    """The 4.57 leg sets DFLASH_EXPECT_TRANSFORMERS so it cannot silently run under another version."""
    expected = os.environ.get("DFLASH_EXPECT_TRANSFORMERS")
    if not expected:
        pytest.skip("DFLASH_EXPECT_TRANSFORMERS not set (main suite)")
    assert transformers.__version__ == expected


def test_demo_checkpoints_are_written_for_both_versions():
    for name in ("target", "ar-draft"):
        cfg = json.loads((MODELS / name / "tokenizer_config.json").read_text())
        assert cfg["tokenizer_class"] == PORTABLE_TOKENIZER_CLASS, name  # not 5.x's TokenizersBackend
        AutoTokenizer.from_pretrained(MODELS / name, local_files_only=True)
    for name in ("target", "ar-draft", "drafter"):
        cfg = json.loads((MODELS / name / "config.json").read_text())
        if "rope_parameters" in cfg:  # 5.x's field; 4.57 reads rope_theta
            assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"], name


def test_make_portable_rewrites_a_transformers5_save(tmp_path):
    make_tokenizer(tmp_path)
    tok_cfg = tmp_path / "tokenizer_config.json"
    data = json.loads(tok_cfg.read_text())
    data["tokenizer_class"] = "TokenizersBackend"  # what transformers 5 writes
    tok_cfg.write_text(json.dumps(data))
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 200,
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "intermediate_size": 96,
                "rope_parameters": {"rope_theta": 500000.0, "rope_type": "linear", "factor": 2.0},
            }
        )
    )
    make_portable(tmp_path)
    assert json.loads(tok_cfg.read_text())["tokenizer_class"] == PORTABLE_TOKENIZER_CLASS
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert tok.decode(tok.encode("def f(x):")) == "def f(x):"
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert AutoConfig.from_pretrained(tmp_path, local_files_only=True).model_type == "llama"


def test_cli_generate_on_the_demo_models(capsys):
    runs = {}
    for mode in ([], ["--no-draft"]):
        assert main(["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "32", "--json", *mode]) == 0
        runs[bool(mode)] = json.loads(capsys.readouterr().out)
    assert runs[False]["token_ids"] == runs[True]["token_ids"] and len(runs[False]["token_ids"]) == 32
    assert runs[False]["stats"]["mean_acceptance_length"] > 1.5  # the trained drafter drafts
    ids = ",".join(map(str, runs[False]["token_ids"][:5]))
    assert main(["generate", "--input-ids", ids, "--max-new-tokens", "4", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4
