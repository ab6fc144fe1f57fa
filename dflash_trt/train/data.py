"""Training data: a code corpus every machine has (the Python standard library), its held-out
split, a byte-level BPE tokenizer, token windows, and the fixed-length training data the CLI and the demo
script cut from a corpus."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .corpus import read_texts as read_texts
from .corpus import stdlib_files as stdlib_files
from .corpus import text_files as text_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from ..models.target import CausalLM
    from .regen import SequenceSet

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int, out: Path) -> PreTrainedTokenizerFast:
    """Byte-level BPE (the `tokenizers` library) with an end-of-text and a mask token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # transformers 5 leaves the fast tokenizer's __init__ unannotated
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token=EOS_TOKEN, mask_token=MASK_TOKEN, pad_token=EOS_TOKEN, model_max_length=2048
    )
    from ..models.target import save_portable

    save_portable(fast, out)  # loadable by transformers 4.57 (TensorRT-LLM 1.2's pin) and 5.x
    return fast


def tokenize_corpus(tokenizer: PreTrainedTokenizerBase, texts: Iterable[str]) -> np.ndarray:
    """All documents, each followed by end-of-text, as one flat token array."""
    eos = tokenizer.eos_token_id
    docs = list(texts)
    ids: list[int] = []
    for batch_start in range(0, len(docs), 256):
        for enc in tokenizer(docs[batch_start : batch_start + 256], add_special_tokens=False)["input_ids"]:
            ids.extend(enc)
            ids.append(eos)
    dtype = np.uint16 if len(tokenizer) < 65536 else np.int32
    return np.asarray(ids, dtype=dtype)


def random_windows(tokens: np.ndarray, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(tokens) - length - 1, (batch,), generator=generator).tolist()
    return torch.from_numpy(np.stack([tokens[s : s + length].astype(np.int64) for s in starts]))


def corpus_prompts(tokens: np.ndarray, n: int, length: int, seed: int = 0) -> torch.Tensor:
    """`n` prompts of `length` tokens cut at seeded random places of the corpus."""
    return random_windows(tokens, n, length, torch.Generator().manual_seed(seed))


def regen_prompts_file(folder: Path, seed: int) -> Path:
    return Path(folder) / f"regen-prompts-seed{seed}.npy"


def write_regen_prompts(tokens: np.ndarray, folder: Path, n: int, length: int, seed: int) -> Path:
    """The prompts `regenerate_dataset` would draw from `tokens`, saved (the corpus's dtype) for another machine:
    n x length tokens instead of the whole corpus."""
    path = regen_prompts_file(folder, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, corpus_prompts(tokens, n, length, seed=seed).numpy().astype(tokens.dtype))
    return path


def corpus_sequences(tokens: np.ndarray, length: int) -> np.ndarray:
    n = len(tokens) // length
    return tokens[: n * length].reshape(n, length)


def load_training_sequences(
    data: str | Path,
    tokenizer: PreTrainedTokenizerBase | None,
    seq_len: int,
    regenerate_with: CausalLM | None = None,
    n_sequences: int = 512,
    prompt_len: int = 64,
    temperature: float = 0.0,
) -> np.ndarray | SequenceSet:
    """`data`: a .npy of token sequences, regenerated responses (a .npz or a folder of shard-*.npz from
    `train.regen`: anchors in the responses only), or text (file, folder, 'stdlib'). With
    `regenerate_with` (the target), prompts cut from the text are continued by the target itself."""
    from .regen import SequenceSet, regenerate

    if str(data).endswith(".npy"):
        rows: np.ndarray = np.load(data)
        return rows
    if str(data).endswith(".npz") or (Path(data).is_dir() and any(Path(data).glob("shard-*.npz"))):
        return SequenceSet.load(Path(data))
    if tokenizer is None:
        raise ValueError(f"training on text ({data}) needs the target's tokenizer; the target folder has none")
    tokens = tokenize_corpus(tokenizer, read_texts(text_files(data)))
    if regenerate_with is None:
        return corpus_sequences(tokens, seq_len)
    prompts = corpus_prompts(tokens, n_sequences, prompt_len)
    return regenerate(regenerate_with, prompts, max(seq_len - prompt_len, 1), temperature)


def regenerate_dataset(
    target_dir: Path,
    out: Path,
    n_sequences: int,
    prompt_len: int,
    new_tokens: int,
    temperature: float = 0.0,
    seed: int = 1,
    device: str = "cpu",
    batch: int = 32,
) -> None:
    """For the demo: prompts from the training split of the stdlib corpus, continued by the target. The prompts
    come from out's folder: regen-prompts-seed{seed}.npy when there (`regen_prompts_file`: what another machine
    drew, so a GPU host continues exactly those), else drawn from train.npy there, else from this interpreter's
    standard library."""
    from ..models.target import load_target, load_tokenizer
    from .regen import regenerate

    target = load_target(target_dir, device=device)
    tok = load_tokenizer(target_dir)
    if tok is None:
        raise ValueError(f"{target_dir} has no tokenizer")
    drawn = regen_prompts_file(out.parent, seed)
    if drawn.exists():
        prompts = torch.from_numpy(np.load(drawn).astype(np.int64))
        if prompts.shape[0] < n_sequences or prompts.shape[1] != prompt_len:
            raise ValueError(f"{drawn} holds {tuple(prompts.shape)} prompts; wanted {n_sequences} x {prompt_len}")
        prompts = prompts[:n_sequences]
        print(f"regen: {n_sequences} prompts from {drawn}", flush=True)
    else:
        cached = out.parent / "train.npy"
        tokens = np.load(cached) if cached.exists() else tokenize_corpus(tok, read_texts(stdlib_files("train")))
        prompts = corpus_prompts(tokens, n_sequences, prompt_len, seed=seed)
    t = time.perf_counter()
    seqs = regenerate(target, prompts, new_tokens, temperature, batch=batch)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, seqs.astype(np.uint16 if len(tok) < 65536 else np.int32))
    print(f"regenerated {seqs.shape[0]} sequences x {seqs.shape[1]} tokens in {time.perf_counter() - t:.0f}s")
