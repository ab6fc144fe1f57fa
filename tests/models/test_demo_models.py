"""The committed demo models load, fit together, stay small, and the drafter really drafts."""

from pathlib import Path

import pytest
from helpers import generate_one

from dflash_trt.decoding import GenerationConfig
from dflash_trt.loading import load_decoder
from dflash_trt.models.target import load_target
from dflash_trt.settings import DEMO_DIR

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
    spec = generate_one(decoder, ids, GenerationConfig(max_new_tokens=64))
    alone = generate_one(decoder, ids, GenerationConfig(max_new_tokens=64, block_size=1))
    assert spec.token_ids == alone.token_ids
    assert spec.text and isinstance(spec.text, str)
    # a trained drafter: more than one token per round on average, where a random one gives 1.0
    assert spec.stats.mean_acceptance_length > 1.5, spec.stats.acceptance_lengths


def test_ar_draft_shares_the_tokenizer(decoder):
    ar = load_target(MODELS / "ar-draft")
    assert ar.config.vocab_size == decoder.target.vocab_size
    assert ar.config.num_hidden_layers <= 2


def test_bfloat16_drafter_keeps_the_target_output(decoder):
    """A drafter in bfloat16 next to the float32 target (what `--drafter-dtype auto` picks on an AMX CPU):
    the output is still the float32 target's own, single-sequence and batched, and it still drafts well."""
    import torch

    from dflash_trt.decoding import BatchDecoder

    bf16 = load_decoder(MODELS / "target", MODELS / "drafter", drafter_dtype_name="bfloat16")
    assert bf16.drafter.drafter.fc.weight.dtype == torch.bfloat16
    assert bf16.drafter.embed_weight.dtype == torch.bfloat16  # its own copy of the target's table
    assert next(bf16.target.model.parameters()).dtype == torch.float32
    prompts = [decoder.encode(p) for p in ("def fibonacci(n):\n", "import os\n\n\nclass Path:\n", "for i in range(")]
    config = GenerationConfig(max_new_tokens=48)
    taus = []
    for ids in prompts:
        alone = generate_one(decoder, ids, GenerationConfig(max_new_tokens=48, block_size=1))
        got = generate_one(bf16, ids, config)
        assert got.token_ids == alone.token_ids
        taus.append(got.stats.mean_acceptance_length)
    assert max(taus) > 2.0, taus
    batch = BatchDecoder(bf16.target, bf16.drafter, block_size=8)
    rows = [batch.add(ids, config) for ids in prompts]
    batch.run()
    for ids, row in zip(prompts, rows):
        assert (
            row.result().token_ids
            == generate_one(decoder, ids, GenerationConfig(max_new_tokens=48, block_size=1)).token_ids
        )
