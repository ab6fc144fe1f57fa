"""Decoding under a grammar (decoding/guided.py), proven against the target alone under the same masks: greedy
output equal in a batch of structured and free rows with every proposer, sampled output distributed as the masked
target (chi-square, with the naive rule as a negative control), forced tokens drafted through the proposer seam,
logprobs equal with speculation on and off and equal to the masked target's."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from clocks import StoppedClock
from helpers import generate_one
from test_spec import N_SAMPLES, SETTINGS, V, chi_square_pvalue, exact_joint, sharp_pair  # noqa: F401
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash_trt.decoding import BatchDecoder, GenerationConfig, GrammarSpec, SamplingParams, compile_grammar
from dflash_trt.decoding import guided as guided_module
from dflash_trt.decoding.proposers import REGISTRY, Prices
from dflash_trt.decoding.sampling import probabilities
from dflash_trt.runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine
from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["function", "class", "module"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
CHOICES = ["return None", "return self", "raise ValueError"]
PHONE = r"[0-9]{3}-[a-z]{2,8}"
PROMPTS = [
    'def parse(argv):\n    """Return the',
    "class Config:\n    def __init__(self, path",
    "import os\nimport sys\n",
]


@pytest.fixture(scope="module")
def demo():
    from dflash_trt.loading import load_decoder

    loaded = load_decoder(DEMO_TARGET, DEMO_DRAFTER)
    assert isinstance(loaded, BatchDecoder) and loaded.tokenizer is not None
    # unpriced (no time passes, `StoppedClock`): the suffix proposer drafts whenever a run matches, so two runs of
    # one request draft alike whatever the machine's load (the forced-drafts test compares their draft counts)
    return BatchDecoder(loaded.target, loaded.drafter, loaded.tokenizer, clock=StoppedClock())


def structured_rows(decoder: BatchDecoder) -> list[tuple[list[int], GenerationConfig]]:
    """A batch of structured rows (each kind, several proposers) and free ones, greedy."""
    rows = [
        (PROMPTS[0], GrammarSpec.json_schema(PERSON), "dflash"),
        (PROMPTS[1], None, "dflash"),
        (PROMPTS[2], GrammarSpec("regex", PHONE), "suffix"),
        (PROMPTS[0], GrammarSpec.choice(CHOICES), "ngram"),
        (PROMPTS[1], GrammarSpec("json_object"), "hybrid"),
        (PROMPTS[2], None, "suffix"),
        (PROMPTS[1], GrammarSpec.json_schema(PERSON), "suffix"),
    ]
    return [
        (decoder.encode(text), GenerationConfig(max_new_tokens=40, grammar=g, proposer=p, logprobs=3))
        for text, g, p in rows
    ]


def check_follows(spec: GrammarSpec | None, text: str, finish: str) -> None:
    """A finished structured output is a string of its grammar."""
    if spec is None or finish != "stop":
        return
    text = text.replace("<|endoftext|>", "")
    if spec.kind == "json_schema":
        value = json.loads(text)
        assert set(value) == {"name", "age", "kind"} and value["kind"] in PERSON["properties"]["kind"]["enum"]
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 120 and len(value["name"]) <= 12
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif spec.kind == "regex":
        assert re.fullmatch(PHONE, text)
    elif spec.kind == "choice":
        assert text in CHOICES


def test_greedy_structured_and_free_rows_in_one_batch_equal_the_target_alone(demo):
    rows = structured_rows(demo)
    spec = demo.generate([p for p, _ in rows], [c for _, c in rows])
    alone = demo.generate([p for p, _ in rows], [replace(c, block_size=1) for _, c in rows])
    for (_, config), s, a in zip(rows, spec, alone):
        assert s.token_ids == a.token_ids, f"{config.grammar} / {config.proposer}: speculation changed the output"
        assert a.stats.drafted_tokens == 0  # block size 1: the target alone, forced tokens included
        check_follows(config.grammar, s.text or "", s.finish_reason)
        # logprobs: the same with speculation on and off
        assert s.logprobs is not None and a.logprobs is not None and len(s.logprobs) == len(s.token_ids)
        for x, y in zip(s.logprobs, a.logprobs):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=2e-4)
            assert [t for t, _ in x.top][:1] == [t for t, _ in y.top][:1]
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=2e-4)
    structured = [s for (_, c), s in zip(rows, spec) if c.grammar is not None]
    assert sum(s.finish_reason == "stop" for s in structured) >= 3, "most structured rows must complete"


def test_forced_tokens_are_drafted_through_the_proposer_seam(demo, monkeypatch):
    prompt = demo.encode(PROMPTS[0])
    base = GenerationConfig(max_new_tokens=40, grammar=GrammarSpec.json_schema(PERSON), proposer="suffix")
    demo.forget_finished_outputs()  # each run's suffix runs come from its own request alone
    forced = generate_one(demo, prompt, base)
    demo.forget_finished_outputs()
    plain = generate_one(demo, prompt, replace(base, forced_drafts=False))
    assert forced.token_ids == plain.token_ids
    # the keys and punctuation are drafted and accepted: more tokens a round than suffix runs alone give
    assert forced.stats.accepted_draft_tokens >= 10
    assert forced.stats.mean_acceptance_length > plain.stats.mean_acceptance_length
    # a proposer class that does not take forced tokens gets none (asked of the class, not its name)
    monkeypatch.setattr(type(REGISTRY["suffix"]), "takes_forced", False)
    demo.forget_finished_outputs()
    off = generate_one(demo, prompt, base)
    assert off.token_ids == forced.token_ids
    assert off.stats.drafted_tokens == plain.stats.drafted_tokens


def test_sampled_logprobs_are_the_masked_targets(demo):
    """A sampled row's logprobs are those of the masked, tempered target after the tokens before (recomputed by
    one forward pass of the whole output)."""
    params = SamplingParams(temperature=0.8, top_k=50, seed=3)
    spec = GrammarSpec.json_schema(PERSON)
    prompt = demo.encode(PROMPTS[1])
    r = generate_one(demo, prompt, GenerationConfig(max_new_tokens=30, sampling=params, grammar=spec, logprobs=0))
    assert r.logprobs is not None and [x.token_id for x in r.logprobs] == r.token_ids
    session = demo.target.new_session()
    row = session.add_row()
    [out] = session.forward([row], [torch.tensor(prompt + r.token_ids[:-1])])
    logits = out.logits[-len(r.token_ids) :].float()
    matcher = compile_grammar(spec, demo.tokenizer, int(demo.target.vocab_size)).matcher()
    for i, t in enumerate(r.token_ids):
        masked = logits[i].masked_fill(~matcher.allowed(), float("-inf"))
        expected = float(probabilities(masked, params)[t].log())
        assert r.logprobs[i].logprob == pytest.approx(expected, abs=1e-3), f"token {i}"
        matcher.accept(t)


# ---- sampling: the masked target's distribution, with a negative control ---------------------------------------
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Six tokens for the sharp pair's vocabulary: end of text, "a", "b", "ab", "c" and the drafter's mask."""
    vocab = {"<e>": 0, "a": 1, "b": 2, "ab": 3, "c": 4, "<m>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<e>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<e>", additional_special_tokens=["<m>"])


# positions where two or three tokens are admitted, one where "c" is forced, and an end of text that may come early
SAMPLED_GRAMMAR = GrammarSpec("regex", "(a|b|ab)c(a|b|c)(ab|a)?")
SAMPLED_PROMPT = [1, 2, 4, 1]
FREE_TOKENS = 3  # the free rows beside them: exactly this many tokens (no stop token), as test_spec's exact_joint


def exact_guided(model, tokenizer, prompt, params, spec, n: int) -> dict[tuple, float]:
    """P(t1..tn) under the target alone with the grammar's mask at every position; the end of text ends a
    sequence (and is part of it, as the loop keeps a stop token)."""
    matcher = compile_grammar(spec, tokenizer, V).matcher()
    out: dict[tuple, float] = {}

    def walk(seq: list[int], prob: float) -> None:
        if len(seq) == n or (seq and seq[-1] == 0):
            out[tuple(seq)] = out.get(tuple(seq), 0.0) + prob
            return
        with torch.no_grad():
            logits = model(torch.tensor([prompt + seq])).logits[0, -1]
        p = probabilities(logits.masked_fill(~matcher.allowed(), float("-inf")), params)
        for t in range(V):
            if p[t] > 0:
                if t == 0:
                    walk(seq + [t], prob * float(p[t]))
                    continue
                assert matcher.accept(t)
                walk(seq + [t], prob * float(p[t]))
                matcher.rollback(1)

    walk([], 1.0)
    return out


def guided_counts(model, drafter, tokenizer, proposer: str) -> tuple[dict, int, dict]:
    """Sampled runs of SAMPLED_GRAMMAR's rows, each batch mixed with as many free rows (FREE_TOKENS each, no stop):
    (the structured rows' counts, their accepted drafts, the free rows' counts)."""
    target = TorchTargetEngine(model, drafter.spec.target_layer_ids)
    decoder = BatchDecoder(target, TorchDrafterEngine.for_target(drafter, target), tokenizer)
    decoder._prices = lambda rows, blocks: [Prices()] * len(rows)  # type: ignore[method-assign]  # unpriced
    counts: dict = {}
    free: dict = {}
    accepted = 0
    # each seed a row of its own generator: rows in one batch are independent draws (the loop's docstring), and a
    # batch of 250 costs the engines a few passes where one request at a time costs 2,000 x its rounds; a free row
    # beside each structured one: masks apply per row, so neither kind may bend the other's distribution
    for start in range(0, N_SAMPLES, 250):
        configs = []
        for seed in range(start, min(start + 250, N_SAMPLES)):
            sampling = SETTINGS["T1"](seed)
            configs.append(
                GenerationConfig(max_new_tokens=4, sampling=sampling, grammar=SAMPLED_GRAMMAR, proposer=proposer)
            )
            other = replace(sampling, seed=N_SAMPLES + seed)
            configs.append(GenerationConfig(max_new_tokens=FREE_TOKENS, sampling=other, proposer=proposer))
        for r, config in zip(decoder.generate([SAMPLED_PROMPT] * len(configs), configs), configs):
            kind = counts if config.grammar is not None else free
            kind[tuple(r.token_ids)] = kind.get(tuple(r.token_ids), 0) + 1
            accepted += r.stats.accepted_draft_tokens if config.grammar is not None else 0
    return counts, accepted, free


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["dflash", "suffix"])
def test_sampled_guided_output_has_the_masked_targets_distribution(sharp_pair, proposer):  # noqa: F811
    """Structured and free rows in the same batches: each kind distributed as the target alone (masked or not)."""
    model, drafter = sharp_pair
    tok = tiny_tokenizer()
    expected = exact_guided(model, tok, SAMPLED_PROMPT, SETTINGS["T1"](0), SAMPLED_GRAMMAR, 4)
    counts, accepted, free = guided_counts(model, drafter, tok, proposer)
    assert accepted > N_SAMPLES * 0.5, "drafts (forced ones at least) must be accepted often enough to test them"
    p = chi_square_pvalue(counts, expected, N_SAMPLES)
    assert p > 1e-3, f"guided {proposer} samples deviate from the masked target (p={p:.2e})"
    p = chi_square_pvalue(free, exact_joint(model, SAMPLED_PROMPT, SETTINGS["T1"](0), FREE_TOKENS), N_SAMPLES)
    assert p > 1e-3, f"free rows beside guided ones deviate from the target alone (p={p:.2e})"


@pytest.mark.slow
def test_statistical_test_catches_drafts_that_ignore_the_grammar(sharp_pair, monkeypatch):  # noqa: F811
    """Negative control: the naive rule (a drafter's distribution left unrestricted, a draft the grammar forbids
    ending the block) must fail the test above."""
    model, drafter = sharp_pair
    tok = tiny_tokenizer()
    monkeypatch.setattr(guided_module, "restrict", lambda q, mask: q)
    expected = exact_guided(model, tok, SAMPLED_PROMPT, SETTINGS["T1"](0), SAMPLED_GRAMMAR, 4)
    counts, _, _ = guided_counts(model, drafter, tok, "dflash")
    assert chi_square_pvalue(counts, expected, N_SAMPLES) < 1e-6
