"""Regeneration (the paper's recipe): the target's own responses to a prompt set, stored resumably.

Prompts go through the chat template (chat kinds) or stay raw (code completions); batches are
left-padded with an attention mask and generation stops at the tokenizer's end tokens. Each sample
keeps its prompt length: anchors and labels are taken from the response only (SpecForge's loss mask).
Output: `shard-NNNNN.npz` files (token ids uint16/int32, lengths, prompt lengths, prompt ids), one per
batch, so an interrupted run loses at most one batch and resumes where it stopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from .prompts import Prompt, encode_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..models.target import CausalLM


@dataclass
class SequenceSet:
    """Variable-length token sequences (prompt + response) with their prompt lengths, stored flat."""

    tokens: np.ndarray  # [total] all sequences concatenated
    offsets: np.ndarray  # [n + 1] start of each sequence in `tokens`
    prompt_lens: np.ndarray  # [n]
    ids: np.ndarray  # [n] prompt ids (str)

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def response_tokens(self) -> int:
        return int((self.lengths - self.prompt_lens).sum())

    def save(self, path: Path) -> None:
        np.savez_compressed(
            path,
            tokens=self.tokens,
            lengths=self.lengths.astype(np.int32),
            prompt_lens=self.prompt_lens.astype(np.int32),
            ids=self.ids.astype(str),
        )

    @classmethod
    def from_arrays(cls, tokens: Any, lengths: Any, prompt_lens: Any, ids: Any) -> SequenceSet:
        """From array-likes (numpy arrays or lists): tokens flat, the other three one entry per sequence."""
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(np.asarray(tokens), offsets, np.asarray(prompt_lens, dtype=np.int64), np.asarray(ids, dtype=str))

    @classmethod
    def load(cls, path: Path) -> SequenceSet:
        """One .npz file, or a folder of shard-*.npz files (concatenated in name order)."""
        files = sorted(Path(path).glob("shard-*.npz")) if Path(path).is_dir() else [Path(path)]
        parts = [np.load(f) for f in files]
        if not parts:
            raise FileNotFoundError(f"no regenerated sequences in {path}")
        return cls.from_arrays(
            np.concatenate([p["tokens"] for p in parts]),
            np.concatenate([p["lengths"] for p in parts]),
            np.concatenate([p["prompt_lens"] for p in parts]),
            np.concatenate([p["ids"] for p in parts]),
        )


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a response: eos plus the chat-end / end-of-text tokens the tokenizer knows."""
    ids: set[int | None] = {tokenizer.eos_token_id}
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)


def cut_response(generated: list[int], stops: set[int], pad: int) -> list[int]:
    """A generated row up to and including its first stop token (the drafter learns to draft the end
    too); a row that never stopped keeps its budget, trailing padding removed."""
    for i, t in enumerate(generated):
        if t in stops:
            return generated[: i + 1]
    while generated and generated[-1] == pad and pad not in stops:
        generated = generated[:-1]
    return generated


@torch.no_grad()
def generate_batch(
    target: CausalLM,
    encoded: list[list[int]],
    max_new_tokens: int,
    stops: list[int],
    pad_id: int,
    temperature: float = 0.0,
) -> list[list[int]]:
    """Left-padded batched generation with an attention mask; the responses, cut at the first stop. With
    no `stops` every row runs its whole budget: fixed-length continuations, kept as generated."""
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, e in enumerate(encoded):
        ids[r, width - len(e) :] = torch.tensor(e)
        mask[r, width - len(e) :] = 1
    length: dict[str, Any] = (
        {"eos_token_id": stops} if stops else {"eos_token_id": None, "min_new_tokens": max_new_tokens}
    )
    out = target.generate(
        ids.to(target.device),
        attention_mask=mask.to(target.device),
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_p=None,
        top_k=None,
        pad_token_id=pad_id,
        **length,
    )
    rows = out[:, width:].cpu()
    if not stops:
        return [row.tolist() for row in rows]
    return [cut_response(row.tolist(), set(stops), pad_id) for row in rows]


def regenerate(
    target: CausalLM, prompts: torch.Tensor, new_tokens: int, temperature: float = 0.0, batch: int = 32, seed: int = 0
) -> np.ndarray:
    """The target's own fixed-length continuations of equal-length prompts [N, prompt_len] (the CLI's and
    the demo's data, cut from a text corpus): [N, prompt_len + new_tokens]."""
    torch.manual_seed(seed)
    outs = []
    for i in tqdm(range(0, prompts.shape[0], batch), desc="regenerate", unit="batch"):
        chunk = prompts[i : i + batch].tolist()
        responses = generate_batch(target, chunk, new_tokens, [], pad_id=0, temperature=temperature)
        outs.append(np.asarray([p + r for p, r in zip(chunk, responses)], dtype=np.int64))
    return np.concatenate(outs)


def regenerate_prompts(
    target: CausalLM,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Prompt],
    out_dir: Path,
    max_new_tokens: int = 256,
    batch: int = 16,
    max_prompt_tokens: int = 1024,
    temperature: float = 0.0,
    time_budget_s: float | None = None,
    seed: int = 0,
) -> SequenceSet | None:
    """Regenerate responses for `prompts` not yet in `out_dir`'s shards; returns everything stored."""
    out_dir.mkdir(parents=True, exist_ok=True)
    done: set[str] = set()
    shards = sorted(out_dir.glob("shard-*.npz"))
    for f in shards:
        done.update(np.load(f)["ids"].tolist())
    todo: list[tuple[str, list[int]]] = []
    for p in prompts:
        if p.id not in done:
            enc = encode_prompt(tokenizer, p)
            if len(enc) <= max_prompt_tokens:
                todo.append((p.id, enc))
    # length-sorted windows: little padding per batch, yet chat / code / long prompts stay mixed over time
    window = batch * 8
    todo = [x for i in range(0, len(todo), window) for x in sorted(todo[i : i + window], key=lambda t: len(t[1]))]
    stops = stop_token_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    dtype = np.uint16 if len(tokenizer) < 65536 else np.int32
    torch.manual_seed(seed + len(shards))
    print(
        f"regenerate: {len(done)} done, {len(todo)} to go (batch {batch}, up to {max_new_tokens} new tokens)",
        flush=True,
    )
    t0, new_tokens, index = time.perf_counter(), 0, len(shards)
    bar = tqdm(range(0, len(todo), batch), desc="regenerate", unit="batch")
    for start in bar:
        chunk = todo[start : start + batch]
        responses = generate_batch(target, [e for _, e in chunk], max_new_tokens, stops, pad, temperature)
        seqs = [e + r for (_, e), r in zip(chunk, responses)]
        SequenceSet.from_arrays(
            np.concatenate([np.asarray(s, dtype=dtype) for s in seqs]),
            [len(s) for s in seqs],
            [len(e) for _, e in chunk],
            [i for i, _ in chunk],
        ).save(out_dir / f"shard-{index:05d}.npz")
        index += 1
        new_tokens += sum(len(r) for r in responses)
        elapsed = time.perf_counter() - t0
        bar.set_postfix(tok_s=f"{new_tokens / elapsed:.1f}")
        if time_budget_s is not None and elapsed > time_budget_s:
            print(f"regenerate: time budget reached after {index} shards", flush=True)
            break
    if new_tokens:
        print(
            f"regenerate: {new_tokens} response tokens in {time.perf_counter() - t0:.0f}s "
            f"({new_tokens / (time.perf_counter() - t0):.1f} tokens/s)",
            flush=True,
        )
    return SequenceSet.load(out_dir) if any(out_dir.glob("shard-*.npz")) else None
