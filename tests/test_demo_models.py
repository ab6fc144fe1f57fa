"""The committed demo models load, fit together, stay small, and the drafter really drafts."""

from pathlib import Path

import pytest

from dflash_trt.settings import DEMO_DIR
from dflash_trt.loading import load_decoder
from dflash_trt.models.target import load_target
from dflash_trt.decoding import GenerationConfig

MODELS = Path(DEMO_DIR)


def _mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def test_demo_models_are_committed_and_small():
    total = sum(_mib(MODELS / name) for name in ("target", "drafter", "ar-draft"))
    assert total <= 50, f"demo models take {total:.1f} MiB (limit 50)"
    # the SmolLM2 drafter has its own budget (the issue's: the drafter only, at most 40 MB)
    if (MODELS / "smollm2-drafter").is_dir():
        assert _mib(MODELS / "smollm2-drafter") <= 40
        assert (MODELS / "smollm2-drafter" / "training.json").is_file()
    for name in ("target", "drafter", "ar-draft"):
        assert (MODELS / name / "config.json").is_file(), name
        assert (MODELS / name / "training.json").is_file(), name


@pytest.fixture(scope="module")
def decoder():
    return load_decoder(MODELS / "target", MODELS / "drafter")


def test_demo_pair_is_lossless_and_accepts_drafts(decoder):
    ids = decoder.encode("def fibonacci(n):\n")
    spec = decoder.generate(ids, GenerationConfig(max_new_tokens=64))
    alone = decoder.generate(ids, GenerationConfig(max_new_tokens=64, block_size=1))
    assert spec.token_ids == alone.token_ids
    assert spec.text and isinstance(spec.text, str)
    # a trained drafter: several tokens per round, where a random one gives 1.0
    assert spec.stats.mean_acceptance_length > 2.0, spec.stats.acceptance_lengths


def test_ar_draft_shares_the_tokenizer(decoder):
    ar = load_target(MODELS / "ar-draft")
    assert ar.config.vocab_size == decoder.target.vocab_size
    assert ar.config.num_hidden_layers <= 2
