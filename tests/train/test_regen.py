"""The offline prompt set and the target's own responses: chat template, EOS stops, padding, resumable shards."""

import numpy as np
import torch
from helpers import make_tokenizer
from tiny_models import make_tiny_target

from dflash_trt.train.prompts import (
    Prompt,
    encode_prompt,
    load_prompts,
    prompts_from_file,
    save_prompts,
)
from dflash_trt.train.regen import (
    SequenceSet,
    cut_response,
    generate_batch,
    regenerate_prompts,
)

SOURCE = '''"""A module."""

import os


def join_words(words, sep=" "):
    """Join the given words with a separator, skipping empty ones.

    More text here.
    """
    # only non-empty words
    kept = [w for w in words if w]
    return sep.join(kept)


class Box:
    def area(self, scale):
        """Return the area of the box times the scale factor."""
        w = self.w * scale
        h = self.h * scale
        return w * h
'''


def test_prompts_from_a_source_file(tmp_path):
    import random

    path = tmp_path / "mod.py"
    path.write_text(SOURCE)
    prompts = prompts_from_file(path, "mod.py", random.Random(0))
    chats = [p.text for p in prompts if p.kind == "chat"]
    assert any(
        "`join_words(words, sep)` that join the given words with a separator, skipping empty ones." in c for c in chats
    )
    assert any("`area(scale)` that return the area of the box times the scale factor." in c for c in chats)
    codes = [p.text for p in prompts if p.kind == "code"]
    # a completion prompt stops after the docstring: the body is the model's to write
    assert any(c.endswith('    More text here.\n    """\n    # only non-empty words\n') for c in codes)
    assert not any("sep.join" in c for c in codes)
    assert all(p.source == "mod.py" for p in prompts) and len({p.id for p in prompts}) == len(prompts)
    save_prompts(prompts, tmp_path / "p.jsonl")
    assert load_prompts(tmp_path / "p.jsonl") == prompts


def test_cut_response_stops_at_the_first_end_token():
    assert cut_response([5, 6, 2, 7, 2], {2}, pad=0) == [5, 6, 2]
    assert cut_response([5, 6, 0, 0], {2}, pad=0) == [5, 6]
    assert cut_response([5, 6, 7], {2}, pad=0) == [5, 6, 7]


def _tiny(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
    )
    target = make_tiny_target(vocab_size=len(tok), layers=2, seed=4)
    return tok, target


def test_left_padded_batch_equals_one_by_one(tmp_path):
    tok, target = _tiny(tmp_path)
    encoded = [tok.encode(t) for t in ("def f(x):\n", "for i in range(10):\n    print(i)\n", "class A:")]
    batched = generate_batch(target, encoded, 12, stops=[tok.eos_token_id], pad_id=tok.eos_token_id)
    for e, got in zip(encoded, batched):
        alone = generate_batch(target, [e], 12, stops=[tok.eos_token_id], pad_id=tok.eos_token_id)[0]
        assert got == alone


def test_chat_template_stops_and_resume(tmp_path):
    tok, target = _tiny(tmp_path)
    prompts = [
        Prompt("a", "x.py", "chat", "write fib"),
        Prompt("b", "x.py", "code", "def fibonacci(n):\n"),
        Prompt("c", "y.py", "chat", "print ten numbers"),
    ]
    assert tok.decode(encode_prompt(tok, prompts[0])) == "user: write fib\nassistant:"
    assert tok.decode(encode_prompt(tok, prompts[1])) == "def fibonacci(n):\n"
    # the tiny target never stops by itself: make the end token its favourite after a few tokens
    stop = tok.eos_token_id
    data = regenerate_prompts(target, tok, prompts[:2], tmp_path / "regen", max_new_tokens=6, batch=1)
    assert len(data) == 2 and sorted(data.ids.tolist()) == ["a", "b"]
    for i in range(2):
        p = next(p for p in prompts if p.id == data.ids[i])
        assert data.sequence(i)[: data.prompt_lens[i]].tolist() == encode_prompt(tok, p)
        response = data.sequence(i)[data.prompt_lens[i] :].tolist()
        assert 1 <= len(response) <= 6 and (stop not in response or response[-1] == stop)
    shards = sorted((tmp_path / "regen").glob("shard-*.npz"))
    assert len(shards) == 2
    mtimes = [s.stat().st_mtime_ns for s in shards]
    data = regenerate_prompts(target, tok, prompts, tmp_path / "regen", max_new_tokens=6, batch=2)
    assert len(data) == 3 and [s.stat().st_mtime_ns for s in shards] == mtimes  # only "c" was generated
    assert data.response_tokens == int(sum(len(data.sequence(i)) - data.prompt_lens[i] for i in range(3)))
    data.save(tmp_path / "all.npz")
    again = SequenceSet.load(tmp_path / "all.npz")
    assert np.array_equal(again.tokens, data.tokens) and np.array_equal(again.prompt_lens, data.prompt_lens)


def test_generation_stops_at_eos(tmp_path):
    tok, target = _tiny(tmp_path)
    with torch.no_grad():  # make the end token the argmax everywhere
        target.lm_head.weight[tok.eos_token_id] = target.lm_head.weight.abs().sum(0) * 10
        target.lm_head.weight[tok.eos_token_id] *= torch.sign(target.model.norm.weight)
    out = generate_batch(target, [tok.encode("def f(x):")], 10, stops=[tok.eos_token_id], pad_id=0)
    assert out[0][-1] == tok.eos_token_id and len(out[0]) < 10
