"""Test helpers: tiny tokenizer, a noisy-oracle drafter, reference decoding."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dflash_trt.runtime.base import Draft

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\nprint(os.path.join('a', 'b'))\n",
]


def make_tokenizer(out: Path, vocab_size: int = 200) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with end-of-text and mask tokens, saved into `out`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|mask|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", mask_token="<|mask|>")
    from dflash_trt.models.target import save_portable

    save_portable(fast, out)
    return fast


class NoisyOracleDrafter:
    """A test double of a drafter (not of hardware): it proposes the target's own greedy
    continuation, corrupted at random, so rounds accept anywhere from 0 to B-1 drafts.
    Random tiny drafters almost never agree with their target; this exercises the
    bookkeeping of long accepted runs that a trained drafter produces."""

    name = "noisy-oracle"

    def __init__(self, reference: list[int], prompt_len: int, vocab: int, block_size: int, p_correct: float, seed: int,
                 feature_layer_ids=()):
        self.reference, self.prompt_len, self.vocab = reference, prompt_len, vocab
        self.block_size, self.p_correct = block_size, p_correct
        self.feature_layer_ids = tuple(feature_layer_ids)
        self.rng = torch.Generator().manual_seed(seed)

    def new_session(self):
        return _OracleSession(self)


class _OracleSession:
    def __init__(self, engine: NoisyOracleDrafter):
        self.engine, self._ctx = engine, 0

    @property
    def context_length(self) -> int:
        return self._ctx

    def draft(self, new_features, last_token, block_size):
        e = self.engine
        self._ctx += new_features.shape[0]
        # last_token sits at position _ctx; drafts are for _ctx+1 .. _ctx+block_size-1
        tokens = []
        for pos in range(self._ctx + 1, self._ctx + block_size):
            i = pos - e.prompt_len
            ok = 0 <= i < len(e.reference) and torch.rand(1, generator=e.rng).item() < e.p_correct
            tokens.append(e.reference[i] if ok else int(torch.randint(e.vocab, (1,), generator=e.rng)))
        t = torch.tensor(tokens, dtype=torch.long)
        logits = torch.full((len(tokens), e.vocab), -10.0)
        logits[torch.arange(len(tokens)), t] = 10.0
        return Draft(logits=logits, tokens=t)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by Hugging Face generate(): the independent reference."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
