"""Training data: a code corpus every machine has (the Python standard library), its held-out
split, a byte-level BPE tokenizer, and token windows."""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"


def stdlib_files(split: str = "train", held_out_every: int = 10) -> list[Path]:
    """Python files of the running interpreter's standard library, split by a stable hash of the
    relative path: 1 in `held_out_every` files is held out (never trained on)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel:
            continue
        held = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % held_out_every == 0
        if (split == "held-out") == held:
            files.append(path)
    return files


def read_texts(paths: Iterable[Path], min_chars: int = 200) -> Iterator[str]:
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib test files are deliberately not UTF-8
        if len(text) >= min_chars:
            yield text


def text_files(data: str | Path) -> list[Path]:
    """`stdlib` (the training split), a text file, or a folder (its *.py, *.txt, *.md files)."""
    if str(data) == "stdlib":
        return stdlib_files("train")
    path = Path(data)
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for ext in ("*.py", "*.txt", "*.md") for p in path.rglob(ext))
    raise FileNotFoundError(f"training data not found: {data} (a file, a folder, or 'stdlib')")


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
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - length - 1, (n,), generator=gen).tolist()
    return torch.from_numpy(np.stack([tokens[s : s + length].astype(np.int64) for s in starts]))


def regen_prompts_file(folder: Path, seed: int) -> Path:
    return Path(folder) / f"regen-prompts-seed{seed}.npy"


def write_regen_prompts(tokens: np.ndarray, folder: Path, n: int, length: int, seed: int) -> Path:
    """The prompts `regenerate_dataset` would draw from `tokens`, saved (the corpus's dtype) for another machine:
    n x length tokens instead of the whole corpus."""
    path = regen_prompts_file(folder, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, corpus_prompts(tokens, n, length, seed=seed).numpy().astype(tokens.dtype))
    return path
