"""z-lab's reference (`dflash` 0.1.0, `dflash.model.dflash_generate`) as the test oracle, beside this project's
decoder on the same saved checkpoints: per round, the drafted tokens and the tokens committed.

Generic: a target directory, a drafter directory (DFlash 1 or DFlash 2, as `config.json`'s `architectures`
says), prompt ids and a block size. Greedy only (sampling is proven by distribution tests against the target
alone). The reference is adapted here, not copied:
- transformers 5.2x needs `activate_past_recording` with an explicit recurrent-state budget before a hybrid
  (linear-attention) cache can be cropped; the reference calls it without one, so `_make_cache` is wrapped to
  pass the block size (a verify pass never holds more tokens than that);
- `_cuda_time` synchronises CUDA, which a CPU build lacks: replaced by `time.perf_counter` while it runs.

Round alignment: the reference verifies `min(B, left + 1)` tokens where this project verifies `min(B, left)`
(`left`: tokens still to generate), so ours runs with one more token to generate; both then verify the same
blocks, and the compared outputs are the reference's length.

Random drafters next to random targets are rarely accepted: the rounds compare what the drafter proposes from
the same features; partial acceptance is exercised with `helpers.NoisyOracleDrafter`.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch


@dataclass
class Rounds:
    """One generation, round by round (the prefill's token is not a round)."""

    output_ids: list[int]  # the new tokens
    drafted: list[list[int]] = field(default_factory=list)  # the B-1 drafted ids of each round ([] when none)
    committed: list[int] = field(default_factory=list)  # tokens committed per round, the target's own included


def reference_drafter(drafter_dir: str | Path) -> Any:
    import dflash.model as ref

    arch = json.loads((Path(drafter_dir) / "config.json").read_text()).get("architectures") or ["DFlashDraftModel"]
    cls = ref.DFlash2DraftModel if arch[0] == "DFlash2DraftModel" else ref.DFlashDraftModel
    return cls.from_pretrained(str(drafter_dir), dtype=torch.float32).eval()


def run_reference(
    target_dir: str | Path, drafter_dir: str | Path, prompt_ids: list[int], block_size: int, max_new_tokens: int
) -> Rounds:
    """`dflash_generate`, greedy, on the checkpoints as transformers and the reference load them."""
    import dflash.model as ref
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    drafter = reference_drafter(drafter_dir)
    drafted: list[list[int]] = []
    make_cache = ref._make_cache

    def budgeted_cache(config: Any) -> Any:
        cache = make_cache(config)
        cache.activate_past_recording(recurrent_states_to_keep=block_size)
        return cache

    def record(tokens: torch.Tensor) -> None:
        drafted.append([int(t) for t in tokens[0]])

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(ref, "_cuda_time", time.perf_counter))
        stack.enter_context(mock.patch.object(ref, "_make_cache", budgeted_cache))
        if isinstance(drafter, ref.DFlash2DraftModel):
            propose = drafter.propose

            def recorded_propose(*args: Any, **kw: Any) -> Any:
                out = propose(*args, **kw)
                record(out[0])
                return out

            stack.enter_context(mock.patch.object(drafter, "propose", recorded_propose))
        else:
            logits_of = drafter.compute_logits

            def recorded_logits(*args: Any, **kw: Any) -> Any:
                out = logits_of(*args, **kw)
                record(out.argmax(-1))
                return out

            stack.enter_context(mock.patch.object(drafter, "compute_logits", recorded_logits))
        stats = ref.dflash_generate(
            drafter,
            target,
            torch.tensor([prompt_ids]),
            max_new_tokens,
            None,
            temperature=0.0,
            block_size=block_size,
            return_stats=True,
        )
    new = [int(t) for t in stats.output_ids[0, len(prompt_ids) :]]
    return Rounds(new, drafted, [int(n) for n in stats.acceptance_lengths])


def run_ours(
    target_dir: str | Path, drafter_dir: str | Path, prompt_ids: list[int], block_size: int, max_new_tokens: int
) -> Rounds:
    """This project's decoder (`load_decoder`: PyTorch engines, as published checkpoints are loaded)."""
    from dflash_trt.decoding import GenerationConfig
    from dflash_trt.loading import load_decoder

    decoder = load_decoder(target_dir, drafter_dir)
    session = decoder.drafter_session
    assert session is not None
    drafted: list[list[int]] = []
    draft = session.draft

    def recorded(requests: Any) -> Any:
        out = draft(requests)
        drafted.extend(d.tokens.tolist() for d in out)
        return out

    with mock.patch.object(session, "draft", recorded):
        cfg = GenerationConfig(max_new_tokens=max_new_tokens + 1, block_size=block_size)  # see the module doc
        [result] = decoder.generate([prompt_ids], cfg)
    return Rounds(result.token_ids[:max_new_tokens], drafted, list(result.stats.acceptance_lengths))


def draft_agreement(ours: Rounds, reference: Rounds) -> float:
    """The share of rounds whose drafted tokens are the reference's (over the longer run's rounds)."""
    rounds = max(len(ours.drafted), len(reference.drafted), 1)
    return sum(a == b for a, b in zip(ours.drafted, reference.drafted)) / rounds


def make_reference_drafter(target_config: Any, out: str | Path, layers: int = 1, block_size: int = 4) -> None:
    """A DFlash 1 drafter built with the reference's own class (random init) and saved as published."""
    import dflash.model as ref
    from transformers import Qwen3Config

    from dflash_trt.models.tiny import tiny_drafter_config

    torch.manual_seed(1)
    raw = tiny_drafter_config(target_config, layers=layers, block_size=block_size)
    config = Qwen3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    model = ref.DFlashDraftModel(config).eval()
    with torch.no_grad():  # wider than the 0.02 init, so drafts vary with the context instead of repeating one id
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.2)
    model.save_pretrained(str(out))
