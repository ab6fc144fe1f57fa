"""The decoding methods the benchmark compares, behind one call: run(prompt_ids, max_new, temperature, seed) -> Run.

    baseline        the target alone through OUR loop with block size 1 (same code path as DFlash)
    hf-generate     Hugging Face `model.generate()`: the library users already know
    dflash-torch-bB DFlash, PyTorch drafter, block size B
    dflash-ort-bB   DFlash, ONNX Runtime drafter, block size B
    hf-assisted     Hugging Face assisted generation with a small autoregressive draft model
    prompt-lookup   Hugging Face prompt-lookup (n-gram) decoding

Time is split the same way for every method: `target_s` is measured by forward hooks on the
target's HF module (prefill and every verify/decode pass), `draft_s` is the proposer (the DFlash
drafter round, or the assistant model's forward passes), `other_s` is the rest (acceptance,
sampling, cache rollback, n-gram lookup, Python and generate() overhead).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from pathlib import Path

    from ..decoding import BatchDecoder
    from ..models.target import CausalLM


@dataclass
class Run:
    token_ids: list[int]
    seconds: float
    # tokens committed per target pass after the first token (a mean, for HF methods whose rounds are unseen)
    acceptance_lengths: list[int] | list[float]
    target_s: float = 0.0
    draft_s: float | None = 0.0  # None: the proposer's time is not separable (inside other_s)

    @property
    def other_s(self) -> float:
        return max(0.0, self.seconds - self.target_s - (self.draft_s or 0.0))


@dataclass(frozen=True)
class Method:
    name: str
    family: str  # baseline | hf-generate | dflash-torch | dflash-ort | hf-assisted | prompt-lookup
    run: Callable[[list[int], int, float, int], Run] = field(compare=False, repr=False)
    block_size: int | None = None
    drafter_backend: str | None = None  # for the ceiling: which drafter timing applies
    lossless: bool = True  # greedy output must equal the baseline's


def target_model(decoder: BatchDecoder) -> CausalLM:
    """The Hugging Face model inside the decoder's PyTorch target engine (the benchmarks time it with forward
    hooks and run its generate())."""
    from ..runtime.torch_backend import TorchTargetEngine

    if not isinstance(decoder.target, TorchTargetEngine):
        raise TypeError(f"the benchmark needs a PyTorch target engine, not {type(decoder.target).__name__}")
    # load_decoder loads it with AutoModelForCausalLM (the engine types it as a plain PreTrainedModel)
    return cast("CausalLM", decoder.target.model)


class ForwardTimer:
    """Wall time and call count of a module's forward passes, plus the KV length each pass started at."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.seconds, self.calls = module, 0.0, 0
        self.starts: list[int] = []
        self._t0 = 0.0
        self._handles = [
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post),
        ]

    def reset(self) -> None:
        self.seconds, self.calls, self.starts = 0.0, 0, []

    def _pre(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        self.starts.append(
            int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else -1
        )
        self._t0 = time.perf_counter()

    def _post(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.seconds += time.perf_counter() - self._t0
        self.calls += 1

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def rounds_from_cache_starts(starts: list[int], prompt_len: int, new_tokens: int) -> list[int] | None:
    """Tokens committed per target pass, from the KV length each pass started at.

    Before pass k the cache holds every committed token but the last, so consecutive starts differ by
    what pass k committed; the first pass counts from prompt_len - 1, the last runs to the end.
    None when the cache lengths were not visible or do not add up (then tau = tokens / passes)."""
    if not starts or any(s < 0 for s in starts):
        return None
    edges = [prompt_len - 1] + starts[1:] + [prompt_len + new_tokens - 1]
    lengths = [b - a for a, b in zip(edges, edges[1:])]
    return lengths if all(n >= 1 for n in lengths) and sum(lengths) == new_tokens else None


def dflash_method(
    name: str,
    family: str,
    decoder: BatchDecoder,
    block_size: int,
    backend: str | None = None,
    proposer: str = "dflash",
) -> Method:
    """The loop as a bench method: DFlash blocks of `block_size`, drafts from `proposer` (decoding/proposers.py)."""
    from ..decoding import GenerationConfig, SamplingParams

    def run(prompt_ids: list[int], max_new: int, temperature: float, seed: int) -> Run:
        cfg = GenerationConfig(
            max_new_tokens=max_new,
            sampling=SamplingParams(temperature, seed=seed),
            block_size=block_size,
            proposer=proposer,
        )
        decoder.forget_finished_outputs()  # each run sees its own request only, as on the first request
        t0 = time.perf_counter()
        [result] = decoder.generate([prompt_ids], cfg)
        seconds = time.perf_counter() - t0
        s = result.stats
        return Run(
            result.token_ids,
            seconds,
            list(s.acceptance_lengths),
            s.prefill_time_s + s.verify_time_s,  # the target's passes: the prefill and every verify
            s.draft_time_s if block_size > 1 else 0.0,
        )

    return Method(name, family, run, block_size, backend)


def hf_method(
    name: str,
    family: str,
    model: CausalLM,
    timer: ForwardTimer,
    pad_token_id: int,
    assistant: CausalLM | None = None,
    assistant_timer: ForwardTimer | None = None,
    **generate_kwargs: Any,
) -> Method:
    """model.generate() with exactly max_new tokens (EOS disabled on the model objects by the caller)."""

    @torch.inference_mode()
    def run(prompt_ids: list[int], max_new: int, temperature: float, seed: int) -> Run:
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new, eos_token_id=None, pad_token_id=pad_token_id, **generate_kwargs
        )
        if temperature > 0:
            # the same distribution as our loop: plain softmax(logits / T), no top-k / top-p
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            kwargs.update(do_sample=False)
        if assistant is not None:
            kwargs["assistant_model"] = assistant
            assert assistant_timer is not None  # an assistant comes with its timer
            assistant_timer.reset()
        ids = torch.tensor([prompt_ids], device=model.device)
        timer.reset()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        seconds = time.perf_counter() - t0
        tokens = out[0, len(prompt_ids) :].tolist()
        lengths: list[int] | list[float] | None = rounds_from_cache_starts(timer.starts, len(prompt_ids), len(tokens))
        if lengths is None:  # tau from the pass count alone
            lengths = [len(tokens) / max(timer.calls, 1)] * max(timer.calls, 1)
        # HF's first pass is the prefill AND the first verification, so it counts as a round here
        draft_s = (
            assistant_timer.seconds
            if assistant_timer is not None and assistant is not None
            else (None if family == "prompt-lookup" else 0.0)
        )
        return Run(tokens, seconds, lengths, timer.seconds, draft_s)

    return Method(name, family, run)


def hf_generate_batch(
    model: CausalLM, prompts: list[list[int]], n: int, pad: int, temperature: float = 0.0
) -> list[list[int]]:
    """Batched model.generate(): left-padded prompts, exactly n new tokens each (EOS off), greedy at
    temperature 0, else plain softmax(logits / T) like our loop. The batched benchmarks' reference."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling: dict[str, Any] = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=pad,
            eos_token_id=None,
            **sampling,
        )
    new: list[list[int]] = out[:, width:].tolist()
    return new


class HFReference:
    """Hugging Face generate() on a load benchmark's stream of requests (the prompts in order, wrapping), in
    left-padded batches of C, one batch after the other: the reference each server mode is held against.
    `requests_for(c)`: how many requests a run at concurrency c sends."""

    name = "hf-generate"

    def __init__(self, target: Path, code_texts: list[str], osl: int, requests_for: Callable[[int], int]):
        from ..models.target import load_target, load_tokenizer

        self.model = load_target(target, torch.float32)
        tok = load_tokenizer(target)
        if tok is None:
            raise ValueError(f"{target} has no tokenizer")
        self.code = [tok.encode(t, add_special_tokens=False) for t in code_texts]
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.osl, self.requests_for = osl, requests_for
        self._warm: set[tuple[int, float]] = set()

    def run(self, c: int, temp: float) -> dict[str, Any]:
        n_req = self.requests_for(c)
        stream = [self.code[i % len(self.code)] for i in range(n_req)]
        if (c, temp) not in self._warm:  # warm-up at this shape, not timed
            hf_generate_batch(self.model, stream[:c], self.osl, self.pad, temp)
            self._warm.add((c, temp))
        t0 = time.perf_counter()
        tokens = 0
        for start in range(0, n_req, c):
            tokens += sum(
                len(o) for o in hf_generate_batch(self.model, stream[start : start + c], self.osl, self.pad, temp)
            )
        secs = time.perf_counter() - t0
        return {
            "mode": self.name,
            "concurrency": c,
            "temperature": temp,
            "requests": n_req,
            "tokens": tokens,
            "seconds": round(secs, 2),
            "tokens_per_s": round(tokens / secs, 1),
        }
