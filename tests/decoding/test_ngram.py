"""The `ngram` proposer (prompt lookup): its lookup is Hugging Face's, its greedy output the target's own."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import generate_one

from dflash_trt.decoding import BatchDecoder, GenerationConfig
from dflash_trt.decoding.proposers import PROPOSERS, NgramProposer, proposer_for
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine


def test_the_lookup_is_hugging_faces_prompt_lookup():
    """The same candidates as transformers' own `PromptLookupCandidateGenerator` (installed with the package) on
    random sequences over a small vocabulary (so that n-grams recur), at its default n-gram size and others."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    rng = random.Random(0)
    found = 0
    for trial in range(400):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 40))]
        ngram, most = rng.choice((1, 2, 3)), rng.randrange(1, 12)
        hf = PromptLookupCandidateGenerator(num_output_tokens=most, max_matching_ngram_size=ngram, max_length=10**6)
        candidates, _ = hf.get_candidates(torch.tensor([tokens]))
        expected = tuple(candidates[0, len(tokens) :].tolist())
        assert NgramProposer(max_ngram_size=ngram).lookup(tokens, most) == expected, (trial, tokens, ngram, most)
        found += bool(expected)
    assert found > 200, "most sequences must have a match for the comparison to mean anything"


def test_ngram_is_in_the_registry_and_drafts_without_a_drafter():
    p = proposer_for("ngram")
    assert "ngram" in PROPOSERS and isinstance(p, NgramProposer)
    assert p.deterministic and not p.uses_drafter and not p.keeps_suffix and not p.weighs_cost


@pytest.mark.parametrize("with_drafter", [True, False])
def test_greedy_ngram_equals_the_target_alone(tiny_pair, with_drafter):
    _, _, _, model, drafter = tiny_pair
    if with_drafter:
        target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
        spec = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target))
    else:
        spec = BatchDecoder(TorchTargetEngine(model))
    base = BatchDecoder(TorchTargetEngine(model))
    rng = torch.Generator().manual_seed(3)
    drafted = accepted = 0
    for trial in range(6):
        phrase = torch.randint(0, 95, (int(torch.randint(3, 10, (1,), generator=rng)),), generator=rng).tolist()
        prompt = phrase * 3 if trial % 2 == 0 else torch.randint(0, 95, (20,), generator=rng).tolist()
        n = int(torch.randint(10, 40, (1,), generator=rng))
        expected = generate_one(base, prompt, GenerationConfig(max_new_tokens=n)).token_ids
        got = generate_one(spec, prompt, GenerationConfig(max_new_tokens=n, proposer="ngram"))
        assert got.token_ids == expected, trial
        assert set(got.stats.drafted_by) <= {"ngram"}  # never the drafter's block
        drafted += got.stats.drafted_by.get("ngram", 0)
        accepted += got.stats.accepted_by.get("ngram", 0)
    assert drafted > 0 and accepted > 0, "n-gram drafts must be verified and accepted for the test to mean anything"
