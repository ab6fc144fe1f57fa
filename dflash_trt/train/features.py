"""The frozen target's features: run only as deep as needed, cached once on disk.

The target's features (and final hidden, for distillation) are computed ONCE into a disk-backed fp16
cache, the target run only up to its deepest feature layer when no teacher is needed.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import numpy as np
import torch
from tqdm import tqdm

from .blocks import pad_batch
from .regen import SequenceSet

if TYPE_CHECKING:
    from ..models.drafter import DFlashDrafter
    from ..models.target import CausalLM

# The `type: ignore[no-untyped-call]`s below: transformers leaves get_decoder unannotated.


class _Deep(Exception):
    """Raised by a hook after the deepest layer needed: the rest of the target is not run."""


@torch.no_grad()
def target_hidden(
    target: CausalLM, tokens: torch.Tensor, layer_ids: Sequence[int], teacher: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Features [b, S, len(ids)*H] (outputs of decoder layers `layer_ids`, = `hidden_states[i + 1]`) and,
    with `teacher`, the final normed hidden [b, S, H] whose lm_head product is the target's logits.
    Without a teacher the target stops after its deepest feature layer; the lm_head never runs. Both come
    back on the target's device."""
    decoder = target.get_decoder()  # type: ignore[no-untyped-call]
    tokens = tokens.to(target.device)
    layers = decoder.layers
    last = len(layers) - 1
    outs: dict[int, torch.Tensor] = {}
    deepest = max(layer_ids)
    stop_early = not teacher and deepest < last

    def hook(idx: int) -> Callable[[torch.nn.Module, Any, Any], None]:
        def fn(module: torch.nn.Module, args: Any, output: Any) -> None:
            outs[idx] = output[0] if isinstance(output, tuple) else output
            if stop_early and idx == deepest:
                raise _Deep

        return fn

    handles = [layers[i].register_forward_hook(hook(i)) for i in set(layer_ids)]
    try:
        final = decoder(input_ids=tokens, use_cache=False).last_hidden_state
    except _Deep:
        final = None
    finally:
        for h in handles:
            h.remove()
    if last in layer_ids:  # HF's hidden_states[-1] is the normed output: match what inference reads
        outs[last] = final if final is not None else decoder(input_ids=tokens, use_cache=False).last_hidden_state
    feats = torch.cat([outs[i] for i in layer_ids], dim=-1).float()
    return feats, (final.float() if teacher else None)


class CacheMeta(TypedDict):
    """A feature cache's `meta.json`: what it holds, and how many sequences are done."""

    layer_ids: list[int]
    feature_size: int
    hidden_size: int
    teacher: bool
    sequences: int
    tokens: int
    ids_hash: str
    done: int


class FeatureCache:
    """The target's features (and teacher hidden) of every token of a SequenceSet, fp16 in memory-mapped
    files, aligned with the set's flat token array. Built once (resumably); `meta.json` says what it holds."""

    def __init__(
        self,
        folder: Path,
        data: SequenceSet,
        layer_ids: Sequence[int],
        feature_size: int,
        hidden_size: int,
        teacher: bool,
    ):
        self.folder, self.data = folder, data
        self.meta: CacheMeta = {
            "layer_ids": list(layer_ids),
            "feature_size": feature_size,
            "hidden_size": hidden_size,
            "teacher": teacher,
            "sequences": len(data),
            "tokens": int(data.offsets[-1]),
            "ids_hash": hash_ids(data.ids),
            "done": 0,
        }
        self.features: np.memmap | None = None
        self.teacher: np.memmap | None = None

    def _files(self) -> tuple[Path, Path, Path]:
        return self.folder / "features.f16", self.folder / "teacher.f16", self.folder / "meta.json"

    def open_or_build(self, target: CausalLM, batch_tokens: int = 8192) -> FeatureCache:
        feat_file, teacher_file, meta_file = self._files()
        want = {k: v for k, v in self.meta.items() if k != "done"}
        mode: Literal["r+", "w+"] = "r+"
        if meta_file.is_file():
            have = json.loads(meta_file.read_text())
            if {k: v for k, v in have.items() if k != "done"} == want:
                self.meta["done"] = have["done"]
            elif self._extends(have):  # more regenerated shards after the same ones: compute only the new part
                print(
                    f"feature cache {self.folder}: {len(self.data) - have['sequences']} new sequences, extending",
                    flush=True,
                )
                self._check_space(self.meta["tokens"] - have["tokens"])
                for f, width in (
                    (feat_file, self.meta["feature_size"]),
                    (teacher_file, self.meta["hidden_size"] if self.meta["teacher"] else 0),
                ):
                    if width:
                        with open(f, "r+b") as fh:
                            fh.truncate(self.meta["tokens"] * width * 2)
                self.meta["done"] = have["done"]
                meta_file.write_text(json.dumps(self.meta))
            else:
                print(f"feature cache {self.folder}: data or layers changed, rebuilding", flush=True)
                shutil.rmtree(self.folder)
        if not meta_file.is_file():
            self.folder.mkdir(parents=True, exist_ok=True)
            self._check_space(self.meta["tokens"])
            mode = "w+"
        n_tok = self.meta["tokens"]
        self.features = np.memmap(feat_file, np.float16, mode, shape=(n_tok, self.meta["feature_size"]))
        if self.meta["teacher"]:
            self.teacher = np.memmap(teacher_file, np.float16, mode, shape=(n_tok, self.meta["hidden_size"]))
        if mode == "w+":
            meta_file.write_text(json.dumps(self.meta))
        self._build(target, batch_tokens)
        return self

    def _check_space(self, tokens: int) -> None:
        need = tokens * (self.meta["feature_size"] + self.meta["hidden_size"] * self.meta["teacher"]) * 2
        free = shutil.disk_usage(self.folder).free
        if need > free * 0.9:
            raise OSError(f"needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free in {self.folder}")

    def _extends(self, have: dict[str, Any]) -> bool:
        """The cache on disk holds the first sequences of this set (same layers): regenerating appends shards."""
        n = int(have.get("sequences", 0))
        same_kind = all(have.get(k) == self.meta[k] for k in ("layer_ids", "feature_size", "hidden_size", "teacher"))
        return (
            same_kind
            and 0 < n < len(self.data)
            and have.get("tokens") == int(self.data.offsets[n])
            and have.get("ids_hash") == hash_ids(self.data.ids[:n])
        )

    def _build(self, target: CausalLM, batch_tokens: int) -> None:
        n, done = len(self.data), self.meta["done"]
        if done >= n:
            return
        lengths = self.data.lengths
        t0, tokens_done = time.perf_counter(), 0
        bar = tqdm(total=n, initial=done, desc="target features", unit="seq")
        assert self.features is not None  # open_or_build maps the files first
        i = done
        while i < n:
            j = i + 1  # as many sequences as fit in `batch_tokens` (padded)
            while j < n and (j + 1 - i) * max(lengths[i : j + 1]) <= batch_tokens:
                j += 1
            batch = pad_batch([self.data.sequence(k) for k in range(i, j)], [0] * (j - i))
            # right padding needs no attention mask: causal attention never looks at later (pad) tokens
            feats, final = target_hidden(target, batch.tokens, self.meta["layer_ids"], teacher=self.meta["teacher"])
            for r, k in enumerate(range(i, j)):
                a, b = self.data.offsets[k], self.data.offsets[k + 1]
                self.features[a:b] = feats[r, : b - a].half().cpu().numpy()
                if final is not None and self.teacher is not None:
                    self.teacher[a:b] = final[r, : b - a].half().cpu().numpy()
            tokens_done += int(batch.lengths.sum())
            i = j
            self.features.flush()
            if self.teacher is not None:
                self.teacher.flush()
            self.meta["done"] = i
            self._files()[2].write_text(json.dumps(self.meta))  # progress after the data: resumable
            bar.update(batch.tokens.shape[0])
            bar.set_postfix(tok_s=f"{tokens_done / (time.perf_counter() - t0):.0f}")
        bar.close()
        print(
            f"target features: {tokens_done} tokens in {time.perf_counter() - t0:.0f}s "
            f"({tokens_done / (time.perf_counter() - t0):.0f} tokens/s) -> {self.folder}",
            flush=True,
        )

    def batch(self, rows: list[int], lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Features [b, width, F] (and teacher hidden [b, width, H] when held) of sequences `rows`, each its
        first `lengths[r]` tokens, zero-padded; in the cache's fp16 until the loss moves them to its device."""
        feats = torch.zeros(len(rows), width, self.meta["feature_size"], dtype=torch.float16)
        hidden = self.meta["hidden_size"]
        teacher = torch.zeros(len(rows), width, hidden, dtype=torch.float16) if self.teacher is not None else None
        for r, k in enumerate(rows):
            f, t = self.get(k)
            n = lengths[r]
            feats[r, :n] = torch.from_numpy(np.asarray(f[:n]))
            if teacher is not None and t is not None:  # both exactly when the cache holds a teacher
                teacher[r, :n] = torch.from_numpy(np.asarray(t[:n]))
        return feats, teacher

    def get(self, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        a, b = self.data.offsets[k], self.data.offsets[k + 1]
        assert self.features is not None  # open_or_build maps the files first
        return self.features[a:b], (self.teacher[a:b] if self.teacher is not None else None)


def hash_ids(ids: np.ndarray) -> str:
    import hashlib

    return hashlib.sha1("\n".join(map(str, ids.tolist())).encode()).hexdigest()[:16]


def open_feature_cache(
    folder: Path | None, data: SequenceSet, drafter: DFlashDrafter, target: CausalLM, teacher: bool
) -> FeatureCache | None:
    """The disk cache of the target's features, built if needed; None (with a loud message) when it cannot
    be written: then every step re-runs the target, several times slower."""
    if folder is None:
        return None
    hidden = target.config.get_text_config().hidden_size
    try:
        return FeatureCache(
            folder, data, drafter.spec.target_layer_ids, drafter.feature_size, hidden, teacher
        ).open_or_build(target)
    except OSError as e:
        print(
            "\n" + "!" * 78 + f"\nWARNING: feature cache {folder} cannot be written ({e}).\n"
            "Training continues WITHOUT it: the target runs again at every step (several times slower).\n"
            + "!" * 78
            + "\n",
            file=sys.stderr,
            flush=True,
        )
        return None
