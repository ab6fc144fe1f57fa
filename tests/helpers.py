"""Test helpers, one of each: the tiny tokenizer; the "tokenizer + tiny target + drafter" checkpoints
(`make_text_models`); the tiny pair without tokenizer (`make_tiny_pair`); drafter wrappers that inject
faults (`FaultyDrafter`) or count the work a session is handed (`CountingDrafter`); the noisy-oracle
drafter; reference decoding."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import make_tiny_drafter, make_tiny_target
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


def make_text_models(root: Path) -> tuple[Path, Path]:
    """A tiny Qwen3 target with a BPE tokenizer (text works) and a tiny DFlash drafter (block size 4) whose
    mask token is the tokenizer's; saved as root/target and root/drafter, which are returned."""
    tok = make_tokenizer(root / "target")
    target = make_tiny_target(root / "target", vocab_size=len(tok), layers=4, seed=1)
    make_tiny_drafter(target.config, root / "drafter", layers=1, block_size=4, mask_token_id=tok.mask_token_id)
    return root / "target", root / "drafter"


def make_tiny_pair(
    root: Path | None = None,
    *,
    family: str = "qwen3",
    vocab_size: int = 96,
    layers: int = 4,
    drafter_layers: int = 1,
    block_size: int = 4,
    seed: int = 0,
    drafter_seed: int = 0,
):
    """A tiny random target (no tokenizer, so no end-of-text token stops a generation) and its drafter:
    (target model, drafter). With `root`, also saved as root/target and root/drafter."""
    target = make_tiny_target(
        None if root is None else root / "target", family=family, vocab_size=vocab_size, layers=layers, seed=seed
    )
    drafter = make_tiny_drafter(
        target.config,
        None if root is None else root / "drafter",
        layers=drafter_layers,
        block_size=block_size,
        seed=drafter_seed,
    )
    return target, drafter


class _WrappedDrafter:
    """Wraps a real drafter engine: same name, block size and feature layers; sessions wrap its sessions."""

    session_class: type

    def __init__(self, engine):
        self.engine, self.name = engine, engine.name
        self.block_size, self.feature_layer_ids = engine.block_size, engine.feature_layer_ids
        self.max_context = engine.max_context

    def new_session(self):
        return self.session_class(self, self.engine.new_session())


class _WrappedDrafterSession:
    def __init__(self, owner, inner):
        self.owner, self.inner = owner, inner

    @property
    def context_length(self) -> int:
        return self.inner.context_length

    def draft(self, new_features, last_token, block_size):
        return self.inner.draft(new_features, last_token, block_size)


class _FaultySession(_WrappedDrafterSession):
    calls = 0

    def draft(self, new_features, last_token, block_size):
        self.calls += 1
        fail_at = self.owner.fail_at
        if self.owner.failing or (fail_at is not None and self.calls >= fail_at):
            raise RuntimeError("injected drafter failure (the engine exploded)")
        return super().draft(new_features, last_token, block_size)


class FaultyDrafter(_WrappedDrafter):
    """Fault injection around a real drafter engine (not a stand-in): its sessions raise while `failing`
    is set, and, with `fail_at`, from each session's `fail_at`-th draft call on."""

    session_class = _FaultySession

    def __init__(self, engine, fail_at: int | None = None):
        super().__init__(engine)
        self.failing, self.fail_at = False, fail_at


class _CountingSession(_WrappedDrafterSession):
    def draft(self, new_features, last_token, block_size):
        self.owner.tokens_handed.append(new_features.shape[0] + block_size)
        return super().draft(new_features, last_token, block_size)


class CountingDrafter(_WrappedDrafter):
    """Wraps a real drafter engine and records, per draft call, the tokens it is handed: new context
    rows plus the block (the cost of a round)."""

    session_class = _CountingSession

    def __init__(self, engine):
        super().__init__(engine)
        self.tokens_handed: list[int] = []


class NoisyOracleDrafter:
    """A test double of a drafter (not of hardware): it proposes the target's own greedy
    continuation, corrupted at random, so rounds accept anywhere from 0 to B-1 drafts.
    Random tiny drafters almost never agree with their target; this exercises the
    bookkeeping of long accepted runs that a trained drafter produces."""

    name = "noisy-oracle"
    max_context = None

    def __init__(
        self,
        reference: list[int],
        prompt_len: int,
        vocab: int,
        block_size: int,
        p_correct: float,
        seed: int,
        feature_layer_ids=(),
    ):
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
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()
