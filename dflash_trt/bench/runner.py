"""One benchmark run: every method on the same target, prompts and settings, interleaved.

For each temperature x max_new_tokens x prompt set x prompt x repeat, all methods run back to back
in an order rotated per prompt and repeat (so machine drift hits them alike). Greedy outputs of
every lossless method are checked against the baseline's; a difference that is not a numerical
tie (logit gap <= tie_tolerance at the first differing position) is a mismatch and fails the run.
"""

from __future__ import annotations

import platform
import statistics
import sys
import tempfile
import time
import weakref
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .measure import PassCosts, PeakRSS, divergence_margin, pass_costs, target_nll
from .methods import ForwardTimer, Method, dflash_method, hf_method, target_model
from .prompts import PROMPT_SETS
from .settings import FAMILIES as FAMILIES
from .settings import BenchSettings as BenchSettings
from .settings import Cell, CellKey
from .summary import headline, histograms, summarise

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..decoding import BatchDecoder
    from ..models.target import CausalLM
    from ..runtime.base import DrafterEngine, TargetEngine
    from ..runtime.ort_backend import OrtDrafterEngine

# (temperature, max_new_tokens, prompt set, prompt index): one group of runs of every method
Group = tuple[float, int, str, int]

DFLASH_FAMILIES = {"torch": "dflash-torch", "onnxruntime": "dflash-ort"}  # drafter backend -> method family

MEMORY_NOTE = (
    "peak_rss_delta_mb: before each run free heap is handed back to the OS (malloc_trim) and the kernel's "
    "peak-RSS counter is reset (/proc/self/clear_refs); after it, VmHWM minus the RSS at the reset. It is "
    "the memory a run newly touches (KV caches, activations, generate() buffers) on top of the weights, "
    "which every method keeps loaded in this one process; the max over the method's runs. weights_mb lists "
    "the weights each method needs (the ONNX graph holds its own copy of the embedding and lm_head)."
)
SAMPLING_NOTE = (
    "At temperature > 0 outputs are samples and cannot be compared token by token; every method here is "
    "lossless in distribution by construction (speculative sampling / exact-match acceptance). As a loose "
    "check, target_nll is the mean negative log-likelihood per generated token under the target at that "
    "temperature: lossless methods should sit near the baseline's value (sampling noise only)."
)
TAU_NOTE = (
    "tau (mean acceptance length): tokens committed per target pass. DFlash: per verify round after the "
    "prefill's first token (the paper's definition, bonus included). HF methods: per target forward of "
    "generate(), the first one being prefill + first verification. Baseline and hf-generate: 1."
)
CEILING_NOTE = (
    "ceiling = tau x t(one target step) / (t(verify B tokens) + t(draft B)), with the three costs timed "
    "directly in this run (timings section) at a context of a typical prompt plus half the new tokens. "
    "DFlash methods only (the HF proposers' per-round draft length varies inside generate())."
)


class BenchError(RuntimeError):
    """A setting or input the benchmark cannot run with (printed as one line by the CLI)."""


# ---- setup ---------------------------------------------------------------------------------
def load_everything(
    s: BenchSettings,
) -> tuple[BatchDecoder, BatchDecoder, dict[str, DrafterEngine], CausalLM | None]:
    """The decoder, the baseline (the same target, no drafter), the drafters by backend, the assistant model."""
    from ..decoding import BatchDecoder
    from ..loading import load_decoder

    want = set(s.methods)
    needs_drafter = bool(want & {"dflash-torch", "dflash-ort"})
    if needs_drafter and s.drafter is None:
        raise BenchError("DFlash methods need --drafter")
    decoder = load_decoder(s.target, s.drafter if needs_drafter else None, s.dtype, s.device, s.drafter_dtype)
    if decoder.tokenizer is None:
        raise BenchError(f"{s.target} has no tokenizer: the prompt sets are text")
    target = decoder.target
    model = target_model(decoder)
    assistant: CausalLM | None = None
    if "hf-assisted" in want:
        from ..models.target import load_target

        if s.ar_draft is None or not (Path(s.ar_draft) / "config.json").is_file():
            raise BenchError(
                f"hf-assisted needs a small autoregressive draft model (--ar-draft; {s.ar_draft} "
                "has no config.json); leave hf-assisted out of --methods to skip it"
            )
        assistant = load_target(s.ar_draft, model.dtype, model.device)
        if assistant.config.vocab_size != model.config.vocab_size:
            raise BenchError(
                f"--ar-draft vocabulary ({assistant.config.vocab_size}) differs from the target's "
                f"({model.config.vocab_size}): assisted generation needs the same tokenizer"
            )
    # Fixed-length runs: no method stops at EOS, so every run of a prompt makes the same number of tokens.
    for m in (model, assistant):
        if m is not None:
            m.generation_config.eos_token_id = None
    if assistant is not None and s.assistant_tokens:
        assistant.generation_config.num_assistant_tokens = s.assistant_tokens
    drafters: dict[str, DrafterEngine] = {}
    if decoder.drafter is not None:
        if "dflash-torch" in want:
            drafters["torch"] = decoder.drafter
        if "dflash-ort" in want:
            drafters["onnxruntime"] = ort_drafter(decoder, s)
    base = BatchDecoder(target, None, decoder.tokenizer)
    return decoder, base, drafters, assistant


# The scratch folder of each ONNX export the benchmark made, held as long as its engine lives: when the engine
# goes, the entry goes and TemporaryDirectory's finalizer removes the folder (run_benchmark cleans up first).
_SCRATCH: weakref.WeakKeyDictionary[DrafterEngine, tempfile.TemporaryDirectory[str]] = weakref.WeakKeyDictionary()


def ort_drafter(decoder: BatchDecoder, s: BenchSettings) -> OrtDrafterEngine:
    from ..runtime import registry
    from ..runtime.base import EngineOptions
    from ..runtime.ort_backend import OrtDrafterEngine
    from ..runtime.torch_backend import TorchDrafterEngine

    folder = s.onnx_drafter
    scratch = None
    if folder is None:
        from ..builders.onnx_drafter import export_drafter

        scratch = tempfile.TemporaryDirectory(prefix="dflash-bench-onnx-")
        folder = Path(scratch.name)
        d = decoder.drafter
        if not isinstance(d, TorchDrafterEngine):
            raise BenchError(
                "exporting the drafter for ONNX Runtime needs the PyTorch drafter (or pass --onnx-drafter)"
            )
        export_drafter(d.drafter, d.embed_weight, d.lm_head_weight, folder, fp16=False)
    engine = registry.drafter_engine("onnxruntime", folder, EngineOptions(precision="fp32", threads=s.threads))
    assert isinstance(engine, OrtDrafterEngine)  # the registry's onnxruntime drafter
    engine.folder = Path(folder)
    # The scratch export lives as long as the engine (run_benchmark removes it at the end; failing that,
    # TemporaryDirectory's finalizer does when the engine goes or the process exits).
    if scratch is not None:
        _SCRATCH[engine] = scratch
    return engine


def build_methods(
    s: BenchSettings,
    decoder: BatchDecoder,
    base: BatchDecoder,
    drafters: dict[str, DrafterEngine],
    assistant: CausalLM | None,
    timer: ForwardTimer,
    assistant_timer: ForwardTimer | None,
) -> list[Method]:
    from ..decoding import BatchDecoder
    from ..decoding.proposers import DEFAULT_PROPOSER

    model = target_model(decoder)
    pad = decoder.tokenizer.pad_token_id if decoder.tokenizer.pad_token_id is not None else 0
    methods = [dflash_method("baseline", "baseline", base, 1)]
    if "hf-generate" in s.methods:
        methods.append(hf_method("hf-generate", "hf-generate", model, timer, pad))
    for backend, drafter in drafters.items():  # drafters: backend name -> engine, as load_everything chose
        family = DFLASH_FAMILIES[backend]
        dec = BatchDecoder(decoder.target, drafter, decoder.tokenizer)
        for p in s.proposers:
            for b in usable_block_sizes(s, drafter):
                name = f"{family}-b{b}" if p == DEFAULT_PROPOSER else f"{family}-{p}-b{b}"  # the default: no suffix
                methods.append(dflash_method(name, family, dec, b, backend, proposer=p))
    if assistant is not None:
        methods.append(
            hf_method(
                "hf-assisted", "hf-assisted", model, timer, pad, assistant=assistant, assistant_timer=assistant_timer
            )
        )
    if "prompt-lookup" in s.methods:
        methods.append(
            hf_method(
                "prompt-lookup",
                "prompt-lookup",
                model,
                timer,
                pad,
                prompt_lookup_num_tokens=s.prompt_lookup_tokens,
                max_matching_ngram_size=s.max_ngram,
            )
        )
    return methods


def usable_block_sizes(s: BenchSettings, drafter: DrafterEngine) -> list[int]:
    """Requested block sizes up to the drafter's trained size (a round cannot draft past it)."""
    return [b for b in s.block_sizes if 2 <= b <= drafter.block_size]


def make_prompts(s: BenchSettings, tokenizer: PreTrainedTokenizerBase) -> dict[str, list[list[int]]]:
    n = max(s.prompts_per_set, s.long_prompts_per_set)
    prompts: dict[str, list[list[int]]] = {}
    for name in s.prompt_sets:
        texts = PROMPT_SETS[name](n)
        prompts[name] = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    return prompts


# ---- the run -------------------------------------------------------------------------------
def run_benchmark(s: BenchSettings) -> dict[str, Any]:
    """Load, check, time the passes, run the plan, summarise: one report (results.json)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # generate()'s advice to users is noise in a benchmark's output
    started = time.time()
    if s.threads:
        torch.set_num_threads(s.threads)
    decoder, base, drafters, assistant = load_everything(s)
    model = target_model(decoder)
    timer = ForwardTimer(model)
    assistant_timer = ForwardTimer(assistant) if assistant is not None else None
    try:
        methods = build_methods(s, decoder, base, drafters, assistant, timer, assistant_timer)
        prompts = make_prompts(s, decoder.tokenizer)
        check_plan(s, methods, prompts, decoder.target.max_context)
        trained = usable_block_sizes(s, next(iter(drafters.values()))) if drafters else list(s.block_sizes)
        skipped = [b for b in s.block_sizes if b not in trained]
        costs = ceiling_costs(s, decoder.target, drafters, methods, prompts)
        warm = prompts[s.prompt_sets[0]][0]  # first calls allocate and pick kernels
        for m in methods:
            m.run(warm, 8, 0.0, 0)
        plan = bench_plan(s)
        cells, done, peak = run_groups(s, methods, prompts, plan, started, decoder.target.vocab_size)
        equality = check_greedy(s, methods, cells, prompts, model)
        add_sampled_nll(s, cells, prompts, model)
        report: dict[str, Any] = {
            "meta": meta(s, decoder, drafters, assistant, methods, started, skipped),
            "notes": {
                "memory": MEMORY_NOTE if peak.available else "peak memory: unavailable on this OS",
                "sampling": SAMPLING_NOTE,
                "tau": TAU_NOTE,
                "ceiling": CEILING_NOTE,
            },
            "timings": {str(L): c for L, c in costs.items()},
            "results": summarise(s, methods, cells, costs),
            "summary": headline(s, methods, cells),
            "acceptance_histograms": histograms(methods, cells),
            "equality": equality,
        }
        report["meta"]["elapsed_s"] = round(time.time() - started, 1)
        report["meta"]["prompt_groups"] = {
            "planned": len(plan),
            "run": done,
            "truncated_by_time_budget": done < len(plan),
        }
        return report
    finally:
        for t in (timer, assistant_timer):
            if t is not None:
                t.remove()
        for d in drafters.values():
            scratch = _SCRATCH.pop(d, None)
            if scratch is not None:
                scratch.cleanup()


def check_plan(s: BenchSettings, methods: list[Method], prompts: dict[str, list[list[int]]], max_context: int) -> None:
    """Refuse settings the run cannot honour, before any timing."""
    if s.corrupt_method and s.corrupt_method not in {m.name for m in methods}:
        raise BenchError(
            f"--corrupt-method {s.corrupt_method!r} is not among the methods run: {', '.join(m.name for m in methods)}"
        )
    for L in s.max_new_tokens:
        longest = max(len(p) for ps in prompts.values() for p in ps) + L
        if longest > max_context:
            raise BenchError(f"a prompt plus {L} new tokens ({longest}) exceeds the target's context ({max_context})")


def ceiling_costs(
    s: BenchSettings,
    target: TargetEngine,
    drafters: dict[str, DrafterEngine],
    methods: list[Method],
    prompts: dict[str, list[list[int]]],
) -> dict[int, PassCosts]:
    """Per-pass costs for the ceiling, at a typical context for each length (prompt + half the new tokens)."""
    costs: dict[int, PassCosts] = {}
    typical = int(statistics.median(len(p) for ps in prompts.values() for p in ps))
    ctx_source = [t for ps in prompts.values() for p in ps for t in p]
    block_sizes = sorted({m.block_size for m in methods if m.block_size and m.block_size > 1})
    for L in s.max_new_tokens:
        ctx = (ctx_source * (1 + (typical + L // 2) // len(ctx_source)))[: typical + L // 2]
        costs[L] = pass_costs(target, drafters, ctx, block_sizes, s.timing_reps)
    return costs


def bench_plan(s: BenchSettings) -> list[Group]:
    """(temperature, length, prompt set, prompt index) groups, prompt index outermost: if the time budget
    runs out, every cell still has its first prompts."""
    return [
        (T, L, name, i)
        for i in range(max(s.prompts_per_set, s.long_prompts_per_set))
        for T in s.temperatures
        for L in s.max_new_tokens
        for name in s.prompt_sets
        if i < (s.prompts_per_set if L <= s.long_threshold else s.long_prompts_per_set)
    ]


def run_groups(
    s: BenchSettings,
    methods: list[Method],
    prompts: dict[str, list[list[int]]],
    plan: list[Group],
    started: float,
    vocab_size: int,
) -> tuple[dict[CellKey, Cell], int, PeakRSS]:
    """Every method on every planned group, order rotated per prompt and repeat. Returns (cells, groups
    run, the peak-memory probe)."""
    from tqdm import tqdm

    peak = PeakRSS()
    cells: dict[CellKey, Cell] = defaultdict(Cell)
    bar = tqdm(
        total=len(plan) * s.repeats * len(methods), desc="bench", unit="run", file=sys.stderr, disable=not s.progress
    )
    done = 0
    for T, L, name, i in plan:
        if done and s.max_minutes is not None and time.time() - started > 60 * s.max_minutes:
            print(
                f"bench: time budget of {s.max_minutes:g} min reached: ran {done} of {len(plan)} prompt groups",
                file=sys.stderr,
            )
            break
        done += 1
        ids = prompts[name][i]
        for r in range(s.repeats):
            rot = (i + r + L + int(T * 10)) % len(methods)
            for m in methods[rot:] + methods[:rot]:
                bar.set_postfix_str(f"T={T:g} {L} {name}#{i} {m.name}")
                peak.reset()
                run = m.run(ids, L, T, 1000 * i + r)  # the seed
                cell = cells[(T, L, name, m.name)]
                cell.peak_mb.append(peak.peak_delta_mb())
                if T == 0 and m.name == s.corrupt_method and run.token_ids:
                    run.token_ids[-1] = (run.token_ids[-1] + 1) % vocab_size
                cell.runs[i].append(run)
                bar.update(1)
    bar.close()
    return cells, done, peak


def add_sampled_nll(
    s: BenchSettings, cells: dict[CellKey, Cell], prompts: dict[str, list[list[int]]], model: CausalLM
) -> None:
    """The target's NLL of each sampled output (the loose losslessness check at T > 0)."""
    for (T, L, name, mname), cell in cells.items():
        if T > 0:
            cell.nll = [target_nll(model, prompts[name][i], runs[0].token_ids, T) for i, runs in cell.runs.items()]


# ---- greedy equality -----------------------------------------------------------------------
def check_greedy(
    s: BenchSettings,
    methods: list[Method],
    cells: dict[CellKey, Cell],
    prompts: dict[str, list[list[int]]],
    model: CausalLM,
) -> dict[str, Any]:
    checked, identical = 0, 0
    ties: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    if 0.0 not in s.temperatures:
        return {"ran": False, "reason": "no temperature-0 runs", "checked": 0, "passed": True}
    for L in s.max_new_tokens:
        for name in s.prompt_sets:
            if (0.0, L, name, "baseline") not in cells:
                continue
            for i, base_runs in cells[(0.0, L, name, "baseline")].runs.items():
                reference = base_runs[0].token_ids
                for m in methods:
                    for r, run in enumerate(cells[(0.0, L, name, m.name)].runs[i]):
                        if not m.lossless or (m.name == "baseline" and r == 0):
                            continue
                        checked += 1
                        if run.token_ids == reference:
                            identical += 1
                            continue
                        pos, gap = divergence_margin(model, prompts[name][i], reference, run.token_ids)
                        entry = {
                            "method": m.name,
                            "prompt_set": name,
                            "prompt": i,
                            "repeat": r,
                            "max_new_tokens": L,
                            "position": pos,
                            "logit_gap": gap if gap != float("inf") else None,
                            "baseline_token": reference[pos] if pos < len(reference) else None,
                            "method_token": run.token_ids[pos] if pos < len(run.token_ids) else None,
                        }
                        (ties if gap <= s.tie_tolerance else mismatches).append(entry)
    return {
        "ran": True,
        "checked": checked,
        "identical": identical,
        "numerical_ties": ties,
        "mismatches": mismatches,
        "tie_tolerance": s.tie_tolerance,
        "passed": not mismatches,
    }


def _mb(module: torch.nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20


def meta(
    s: BenchSettings,
    decoder: BatchDecoder,
    drafters: dict[str, DrafterEngine],
    assistant: CausalLM | None,
    methods: list[Method],
    started: float,
    skipped: list[int],
) -> dict[str, Any]:
    import transformers

    from ..runtime.ort_backend import OrtDrafterEngine
    from ..runtime.torch_backend import TorchDrafterEngine

    target_mb = _mb(target_model(decoder))
    weights = {"baseline": target_mb, "hf-generate": target_mb, "prompt-lookup": target_mb}
    torch_drafter = drafters.get("torch")
    if isinstance(torch_drafter, TorchDrafterEngine):
        weights["dflash-torch"] = target_mb + _mb(torch_drafter.drafter)
    ort_engine = drafters.get("onnxruntime")
    if isinstance(ort_engine, OrtDrafterEngine):
        folder = ort_engine.folder
        weights["dflash-ort"] = target_mb + sum(f.stat().st_size for f in folder.glob("drafter.onnx*")) / 2**20
    if assistant is not None:
        weights["hf-assisted"] = target_mb + _mb(assistant)
    try:
        import onnxruntime

        ort_version = onnxruntime.__version__
    except ImportError:  # pragma: no cover
        ort_version = None
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()}
    return {
        "settings": settings,
        "methods": [{"name": m.name, "family": m.family, "block_size": m.block_size} for m in methods],
        "skipped_block_sizes": skipped,
        "trained_block_size": next(iter(drafters.values())).block_size if drafters else None,
        "weights_mb": {k: round(v, 1) for k, v in weights.items()},
        "assistant": None
        if assistant is None
        else {
            "num_assistant_tokens": assistant.generation_config.num_assistant_tokens,
            "schedule": assistant.generation_config.num_assistant_tokens_schedule,
            "confidence_threshold": assistant.generation_config.assistant_confidence_threshold,
        },
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": __import__("os").cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "onnxruntime": ort_version,
            "python": platform.python_version(),
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
    }
