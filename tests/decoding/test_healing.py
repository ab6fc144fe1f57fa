"""Healed prompt boundaries (decoding/healing.py) on the demo pair: a prompt ending in a newline is backed up,
the first token starts with the removed text, the completion leaves it out, and greedy output is still the
target's own for the healed prompt, speculative or not."""

from pathlib import Path

import pytest
import torch
from helpers import generate_one

from dflash_trt.decoding import GenerationConfig
from dflash_trt.decoding.healing import Healing, PromptHealer
from dflash_trt.loading import load_decoder
from dflash_trt.settings import DEMO_DIR

MODELS = Path(DEMO_DIR)
MEAN = 'def mean(values):\n    """Return the arithmetic mean of a list of numbers."""'  # the README's example
STOPS = ("\ndef ",)


@pytest.fixture(scope="module")
def decoder():
    return load_decoder(MODELS / "target", MODELS / "drafter")


def test_a_trailing_newline_is_backed_up_and_constrains_the_first_token(decoder):
    healer = PromptHealer(decoder.tokenizer)
    ids = decoder.encode(MEAN + "\n")
    healed, healing = healer.heal(ids)
    assert healing is not None and healing.text == "\n" and healed == ids[:-1]
    texts = healer.texts()
    assert ids[-1] in healing.allowed and len(healing.allowed) > 1
    assert all(texts[i].startswith("\n") for i in healing.allowed)
    assert any(t.startswith("\n ") for t in (texts[i] for i in healing.allowed))  # newline + indentation
    # nothing to heal: a single token, or a last token no other token extends
    assert healer.heal(ids[:1]) == (ids[:1], None)
    lone = next(i for i, t in enumerate(texts) if t and not any(u != t and u.startswith(t) for u in texts))
    assert healer.heal([ids[0], lone]) == ([ids[0], lone], None)


def test_constrain_masks_only_the_first_position():
    logits = torch.zeros(3, 6)
    out = Healing("x", (1, 4)).constrain(logits)
    assert torch.isinf(out[0, [0, 2, 3, 5]]).all() and (out[0, [1, 4]] == 0).all()
    assert (out[1:] == 0).all() and (logits == 0).all()  # later positions free, the input untouched


@pytest.mark.parametrize("block_size", [None, 1])
def test_healed_output_is_the_targets_own_and_the_body_the_same_with_or_without_the_newline(decoder, block_size):
    base = GenerationConfig(max_new_tokens=48, stop_strings=STOPS, block_size=block_size)
    healed_cfg = GenerationConfig(max_new_tokens=48, stop_strings=STOPS, block_size=block_size, heal_prompt=True)
    with_newline = generate_one(decoder, decoder.encode(MEAN + "\n"), healed_cfg)
    without = generate_one(decoder, decoder.encode(MEAN), base)
    healed_ids, healing = decoder.healer.heal(decoder.encode(MEAN + "\n"))
    assert healing is not None
    # the healed prompt is the prompt without the newline here, and the first token starts with the newline
    assert healed_ids == decoder.encode(MEAN)
    assert decoder.tokenizer.decode(with_newline.token_ids[:1]).startswith("\n")
    assert with_newline.token_ids == without.token_ids  # the model chose a newline token anyway
    assert with_newline.text is not None and without.text is not None
    assert "\n" + with_newline.text == without.text  # the completion leaves out what the prompt holds
    assert with_newline.stats.prompt_tokens == len(healed_ids)


def test_speculative_equals_target_alone_for_healed_prompts(decoder):
    """Greedy losslessness under healing, over prompts ending where a merge is likely."""
    for prompt in (MEAN + "\n", "def add(a, b):\n    return a", "import os\nimport s"):
        cfg = GenerationConfig(max_new_tokens=32, heal_prompt=True)
        spec = generate_one(decoder, decoder.encode(prompt), cfg)
        alone = generate_one(
            decoder, decoder.encode(prompt), GenerationConfig(max_new_tokens=32, heal_prompt=True, block_size=1)
        )
        assert spec.token_ids == alone.token_ids and spec.text == alone.text
        healed, healing = decoder.healer.heal(decoder.encode(prompt))
        if healing is not None:
            first = decoder.tokenizer.decode(spec.token_ids[:1])
            assert first.startswith(healing.text)


def test_a_stop_string_in_the_removed_text_does_not_cut_the_output(decoder):
    """A healed newline is the prompt's: a stop at the next newline keeps the first line of the body (its tokens
    and its text), it does not stop at the healed newline itself."""
    cfg = GenerationConfig(max_new_tokens=48, stop_strings=("\n",), heal_prompt=True)
    healed = generate_one(decoder, decoder.encode(MEAN + "\n"), cfg)
    plain = generate_one(decoder, decoder.encode(MEAN + "\n"), GenerationConfig(max_new_tokens=48))
    assert healed.finish_reason == "stop" and healed.text and "\n" not in healed.text
    assert healed.text.strip()  # the body's first line, not nothing
    assert decoder.tokenizer.decode(healed.token_ids).lstrip("\n").startswith(healed.text)
    assert len(healed.token_ids) >= 2 and plain.token_ids  # the first token plus the line's


def test_allowed_sets_are_every_token_starting_with_the_text(decoder):
    healer = PromptHealer(decoder.tokenizer)
    texts = healer.texts()
    for tail in ("\n", " ", "def", "\n    ", "(", "x", "zzzz-none"):
        assert healer.allowed(tail) == tuple(i for i, t in enumerate(texts) if t.startswith(tail)), tail


def test_the_healer_keeps_nothing_per_last_token(decoder):
    """A server heals every text prompt with one healer: after its first request it must not grow with the last
    tokens it meets (a set per token id, kept, grows towards the vocabulary's prefix pairs)."""
    import gc
    import tracemalloc

    healer = PromptHealer(decoder.tokenizer)
    healer.heal([5, 6])  # the texts are decoded and sorted on first use
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        healed = [healer.heal([5, last]) for last in range(2, len(healer.texts()))]
        assert sum(h is not None for _, h in healed) > 100  # many of them were healed
        del healed
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 64 * 1024, f"the healer kept {kept} bytes after healing every last token once"
