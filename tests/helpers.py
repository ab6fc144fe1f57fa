"""Test helpers, one of each: the tiny tokenizer; the "tokenizer + tiny target + drafter" checkpoints
(`make_text_models`); the tiny pair without tokenizer (`make_tiny_pair`); drafter wrappers that inject
faults (`FaultyDrafter`) or count the work a session is handed (`CountingDrafter`); the noisy-oracle
drafter; reference decoding (`hf_greedy`) and reference single-sequence engines (`HfSequenceTarget`,
`DrafterSequence`, behind the per-row adapters: `sequence_engines`); one request alone (`generate_one`)."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import make_tiny_drafter, make_tiny_target
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dflash_trt.decoding import BatchDecoder, GenerationConfig, GenerationResult
from dflash_trt.models.target import extract_features
from dflash_trt.runtime.base import Draft, TargetOutput
from dflash_trt.runtime.rows import PerRowDrafter, PerRowTarget

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\nprint(os.path.join('a', 'b'))\n",
]


# A tiny Jinja chat template, so tests can tell a rendered chat prompt from plain text.
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def make_tokenizer(out: Path, vocab_size: int = 200, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with end-of-text and mask tokens (and `chat_template`), saved into `out`."""
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
    fast.chat_template = chat_template
    from dflash_trt.models.target import save_portable

    save_portable(fast, out)
    return fast


def make_text_models(root: Path, chat: bool = True) -> tuple[Path, Path]:
    """A tiny Qwen3 target with a BPE tokenizer (text works; with `chat`, CHAT_TEMPLATE too) and a tiny
    DFlash drafter (block size 4) whose mask token is the tokenizer's; saved as root/target and
    root/drafter, which are returned."""
    tok = make_tokenizer(root / "target", chat_template=CHAT_TEMPLATE if chat else None)
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
        self.engine, self.name, self.dtype = engine, engine.name, engine.dtype
        self.block_size, self.feature_layer_ids = engine.block_size, engine.feature_layer_ids
        self.max_context = engine.max_context

    def new_session(self):
        return self.session_class(self, self.engine.new_session())


class _WrappedDrafterSession:
    """A row session (base.DrafterSession) that hands every call on to the real engine's session."""

    def __init__(self, owner, inner):
        self.owner, self.inner = owner, inner

    def add_row(self) -> int:
        return self.inner.add_row()

    def remove_row(self, row: int) -> None:
        self.inner.remove_row(row)

    def context_length(self, row: int) -> int:
        return self.inner.context_length(row)

    def draft(self, requests):
        return self.inner.draft(requests)


class _FaultySession(_WrappedDrafterSession):
    calls = 0

    def draft(self, requests):
        self.calls += 1
        fail_at = self.owner.fail_at
        if self.owner.failing or (fail_at is not None and self.calls >= fail_at):
            raise RuntimeError("injected drafter failure (the engine exploded)")
        return super().draft(requests)


class FaultyDrafter(_WrappedDrafter):
    """Fault injection around a real drafter engine (not a stand-in): its sessions raise while `failing`
    is set, and, with `fail_at`, from each session's `fail_at`-th draft call on (one call per decoder
    step that drafts, for every drafting row at once)."""

    session_class = _FaultySession

    def __init__(self, engine, fail_at: int | None = None):
        super().__init__(engine)
        self.failing, self.fail_at = False, fail_at


class _CountingSession(_WrappedDrafterSession):
    def draft(self, requests):
        self.owner.tokens_handed.extend(q.new_features.shape[0] + q.block_size for q in requests)
        return super().draft(requests)


class CountingDrafter(_WrappedDrafter):
    """Wraps a real drafter engine and records, per drafted row of each call, the tokens it is handed: new
    context rows plus the block (the cost of a round)."""

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
    dtype = "float32"  # no network: its drafts are the reference's tokens, corrupted at random

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

    def sequence(self) -> _OracleSequence:
        """One sequence's drafter (rows.SequenceDrafter)."""
        return _OracleSequence(self)

    def new_session(self):
        return PerRowDrafter(self.sequence)


class _OracleSequence:
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


class HfSequenceTarget:
    """Reference (not a stand-in): one sequence through the Hugging Face forward with its DynamicCache (what
    the single-sequence PyTorch session did before the row sessions): a `rows.SequenceTarget`, so
    `PerRowTarget` serves it as a target session. The row sessions' results are checked against it."""

    def __init__(self, model, feature_layer_ids=()):
        import inspect

        from transformers import DynamicCache

        self.model, self.feature_layer_ids = model, tuple(feature_layer_ids)
        self.cache = DynamicCache(config=model.config)
        params = inspect.signature(model.forward).parameters  # transformers 5.x renamed past_key_values
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, token_ids, *, last_logits_only: bool = False, features: bool = True):
        ids = token_ids.view(1, -1)
        positions = torch.arange(self.length, self.length + ids.shape[1]).unsqueeze(0)
        want = features and bool(self.feature_layer_ids)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            **{self.cache_kwarg: self.cache},
            logits_to_keep=1 if last_logits_only else 0,
            output_hidden_states=want,
        )
        feats = extract_features(out.hidden_states, self.feature_layer_ids)[0] if want else None
        return TargetOutput(logits=out.logits[0].float(), features=feats)

    def rollback(self, length: int) -> None:
        extra = self.length - length
        if extra < 0:
            raise ValueError(f"cannot roll back to {length}: only {self.length} tokens cached")
        if extra:
            self.cache.crop(-extra)  # a negative count drops that many tokens (transformers 4.57 and 5.x)

    def close(self) -> None:
        pass


class DrafterSequence:
    """Reference (not a stand-in): one sequence through the drafter's own forward and context cache (what
    the single-sequence PyTorch drafter session did): a `rows.SequenceDrafter`."""

    def __init__(self, engine):
        self.engine = engine  # a TorchDrafterEngine: the drafter and the target's embedding and lm_head
        self.past_k, self.past_v = engine.drafter.empty_cache(device=engine.embed_weight.device)

    @property
    def context_length(self) -> int:
        return self.past_k.shape[3]

    @torch.inference_mode()
    def draft(self, new_features, last_token: int, block_size: int) -> Draft:
        e = self.engine
        block = torch.full((1, block_size), e.mask_token_id, dtype=torch.long, device=e.embed_weight.device)
        block[0, 0] = last_token
        feats = new_features.to(dtype=self.past_k.dtype, device=block.device).unsqueeze(0)
        hidden, self.past_k, self.past_v = e.drafter(
            feats, e.drafter.embed_block(block, e.embed_weight), self.past_k, self.past_v
        )
        logits, tokens, cands, scores = e.drafter.block_outputs(hidden[:, 1:], block[:, 0], e.lm_head_weight)
        first = lambda t: None if t is None else t[0]  # noqa: E731
        return Draft(logits=logits[0], tokens=tokens[0], candidates=first(cands), step_scores=first(scores))


class SequenceTargetEngine:
    """Reference engine: `HfSequenceTarget` per row behind `rows.PerRowTarget` (the per-row path a TensorRT
    plan or a TensorRT-LLM request takes)."""

    name = "hf-sequence"

    def __init__(self, model, feature_layer_ids=()):
        text = model.config.get_text_config()
        self.model, self.feature_layer_ids = model, tuple(feature_layer_ids)
        self.vocab_size, self.max_context = int(text.vocab_size), int(text.max_position_embeddings)

    def new_session(self):
        return PerRowTarget(lambda: HfSequenceTarget(self.model, self.feature_layer_ids))


class SequenceDrafterEngine:
    """Reference engine: `DrafterSequence` per row behind `rows.PerRowDrafter`."""

    name = "drafter-sequence"

    def __init__(self, engine):
        self.engine, self.dtype = engine, engine.dtype
        self.block_size, self.feature_layer_ids = engine.block_size, engine.feature_layer_ids
        self.max_context = engine.max_context

    def new_session(self):
        return PerRowDrafter(lambda: DrafterSequence(self.engine))


def sequence_engines(model, drafter) -> tuple[SequenceTargetEngine, SequenceDrafterEngine]:
    """The reference (target, drafter) engines, one sequence per row, for a Hugging Face model and a drafter."""
    from dflash_trt.runtime.torch_backend import TorchDrafterEngine, shared_weights

    embed, head = shared_weights(drafter, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return (
        SequenceTargetEngine(model, drafter.spec.target_layer_ids),
        SequenceDrafterEngine(TorchDrafterEngine(drafter, embed, head)),
    )


def generate_one(decoder: BatchDecoder, prompt, config: GenerationConfig = GenerationConfig()) -> GenerationResult:
    """One request alone: a batch of one, run to the end."""
    return decoder.generate([prompt], config)[0]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by Hugging Face generate(): the independent reference."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()
