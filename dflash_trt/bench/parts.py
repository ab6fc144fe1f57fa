"""The parts of a round, timed one by one: our engines' passes beside the reference's modules on the same shapes,
the loop's host work on the real engines, and the host work alone on engines that cost nothing.

- Engine passes (`engine_parts`): for C rows holding the same context, one target step (1 token per row, no
  features), one verify pass (B tokens per row, with the drafter's features) and one drafter pass (B-block,
  (B+1)//2 new context features per row: a round's typical backlog, as `measure.pass_costs`). Ours: the
  PyTorch engines' sessions. The reference's (`reference_parts`): z-lab's `dflash` package, whose
  `dflash_generate` runs the target's own Hugging Face forward on a `DynamicCache` and its drafter's forward
  + `compute_logits`; the same shapes, batched to C rows (the reference serves one request, so at C > 1 this
  is what its modules cost on the batch, the bar our batched passes are held to). Each sample alternates
  ours and the reference's, so drift on a shared machine hits both alike; medians.
- Host work per step on the real engines (`loop_host`): `StepProfile` splits a step's wall time into the
  passes and the rest; the rest (policy, acceptance, commits, rollbacks, detokenizing, stop checks) is host.
- Host work alone (`sim_host`): the loop on the simulator's engines (sim/engines.py), which run no model;
  the wall time of a step less the time spent inside those fake engines' own Python is what the loop costs
  the host at that batch, policy included. The serving simulator's host term reads these figures
  (`sim.serving.host_step_s`).
- The demo (C = 1) against the reference's `dflash_generate`, alternating.

Prints tables, writes JSON (`dflash-trt bench parts`, `make bench-parts`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from ..decoding import BatchDecoder, GenerationConfig
from ..runtime.base import DraftRequest

if (
    TYPE_CHECKING
):  # at run time imported where used: transformers loads with it, and `dflash-trt --help` reads this module
    from ..runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def alternate(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 2) -> dict[str, float]:
    """Median ms of each of `fns`, called in turn (A, B, A, B, ...) so that load on the machine hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + reps):
        for name, fn in fns.items():
            t = _ms(fn)
            if i >= warmup:
                times[name].append(t)
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


class OurParts:
    """Our engines' sessions holding C rows of one context, ready to time a step, a verify and a draft."""

    def __init__(self, target: TorchTargetEngine, drafter: TorchDrafterEngine, context: list[int], c: int, block: int):
        self.block, self.new = block, (block + 1) // 2
        self.ts, self.ds = target.new_session(), drafter.new_session()
        self.rows = [self.ts.add_row() for _ in range(c)]
        ids = torch.tensor(context)
        outs = self.ts.forward(self.rows, [ids] * c, last_logits_only=True)
        feats = outs[0].features
        assert feats is not None
        self.feats = feats
        self.drows = [self.ds.add_row() for _ in range(c)]
        self.ds.draft([DraftRequest(r, feats[: -self.new], context[-1], block) for r in self.drows])
        self.n, self.ctx = len(context), len(context) - self.new
        self.last = ids[-1:]
        self.blocks = ids[-block:]

    def _rollback(self) -> None:
        for r in self.rows:
            self.ts.rollback(r, self.n)

    def step(self) -> None:
        self.ts.forward(self.rows, [self.last] * len(self.rows), features=False)
        self._rollback()

    def verify(self) -> None:
        self.ts.forward(self.rows, [self.blocks] * len(self.rows), features=True)
        self._rollback()

    def draft(self) -> None:
        tail = self.feats[-self.new :]
        self.ds.draft([DraftRequest(r, tail, int(self.last), self.block) for r in self.drows])
        for r in self.drows:  # the drafter's context only grows; back to before this round for the next sample
            self.ds.slots.lengths[r] = self.ctx


class ReferenceParts:
    """The same three passes through z-lab's reference modules (`dflash.model`): the target's Hugging Face
    forward on its `DynamicCache` (cropped back after each pass, as `dflash_generate` does), and its drafter's
    forward + `compute_logits` + argmax, the work one round of `dflash_generate` does per pass."""

    def __init__(self, target_model: Any, drafter: Any, context: list[int], c: int, block: int):
        from dflash import model as ref

        self.ref, self.target, self.drafter = ref, target_model, drafter
        self.block, self.new, self.n = block, (block + 1) // 2, len(context)
        self.ctx = self.n - self.new
        ids = torch.tensor([context] * c)
        self.pos = torch.arange(self.n + block + 1)[None]
        self.cache = ref._make_cache(target_model.config)
        with torch.inference_mode():
            out = target_model(
                ids,
                position_ids=self.pos[:, : self.n],
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
                output_hidden_states=True,
            )
            self.feats = ref.extract_context_feature(out.hidden_states, drafter.target_layer_ids)
            self.dcache = ref._make_cache(drafter.config)
            self._draft(self.feats[:, : self.ctx], 0)
            ref._crop_to(self.dcache, self.ctx)
        self.last, self.blocks = ids[:, -1:], ids[:, -block:]
        self.head = ref._output_head(target_model)

    @torch.inference_mode()
    def step(self) -> None:
        pos = self.pos[:, self.n : self.n + 1]
        self.target(self.last, position_ids=pos, past_key_values=self.cache, use_cache=True)
        self.ref._crop_to(self.cache, self.n)

    @torch.inference_mode()
    def verify(self) -> None:
        pos = self.pos[:, self.n : self.n + self.block]
        out = self.target(
            self.blocks, position_ids=pos, past_key_values=self.cache, use_cache=True, output_hidden_states=True
        )
        self.ref.extract_context_feature(out.hidden_states, self.drafter.target_layer_ids)
        self.ref._crop_to(self.cache, self.n)

    def _draft(self, feats: torch.Tensor, start: int) -> torch.Tensor:
        ref, d = self.ref, self.drafter
        block_ids = torch.full((feats.shape[0], self.block), int(d.mask_token_id), dtype=torch.long)
        block_ids[:, 0] = self.last[:, 0] if hasattr(self, "last") else 0
        scale = float(ref._draft_value(d.config, "input_embedding_scale", 1.0))
        noise = ref._raw_input_embeddings(self.target, block_ids, scale)
        pos = torch.arange(start, start + feats.shape[1] + self.block)[None]
        hidden: torch.Tensor = d(
            target_hidden=feats, noise_embedding=noise, position_ids=pos, past_key_values=self.dcache, use_cache=True
        )
        return hidden[:, 1 - self.block :, :]

    @torch.inference_mode()
    def draft(self) -> None:
        hidden = self._draft(self.feats[:, self.ctx :], self.ctx)
        self.ref._crop_to(self.dcache, self.n)
        self.drafter.compute_logits(hidden, self.head).argmax(-1)
        self.ref._crop_to(self.dcache, self.ctx)


def load_reference_drafter(path: str, dtype: torch.dtype = torch.float32) -> Any:
    """z-lab's DFlashDraftModel from a published-format drafter directory (ImportError without `dflash`)."""
    from dflash.model import DFlashDraftModel

    return DFlashDraftModel.from_pretrained(path, dtype=dtype).eval()


def engine_parts(
    target: TorchTargetEngine,
    drafter: TorchDrafterEngine,
    ref_drafter: Any,
    context: list[int],
    c: int,
    block: int,
    reps: int,
) -> dict[str, dict[str, float]]:
    """Median ms of a target step, a verify of `block` tokens and a drafter pass, for C rows: ours and the
    reference's, alternating."""
    ours = OurParts(target, drafter, context, c, block)
    theirs = ReferenceParts(target.model, ref_drafter, context, c, block)
    out: dict[str, dict[str, float]] = {"ours": {}, "reference": {}}
    for part in ("step", "verify", "draft"):
        got = alternate({"ours": getattr(ours, part), "reference": getattr(theirs, part)}, reps)
        out["ours"][part], out["reference"][part] = got["ours"], got["reference"]
    return out


def reference_generate(ref_drafter: Any, target_model: Any, prompt: list[int], max_new: int, block: int) -> list[int]:
    """z-lab's `dflash_generate`, greedy, no stop tokens; its `_cuda_time` (a CUDA synchronize) is replaced by
    the plain clock so that it runs on a CPU. Returns the new tokens."""
    from dflash import model as ref

    ref._cuda_time = time.perf_counter
    ids = torch.tensor([prompt])
    out = ref.dflash_generate(ref_drafter, target_model, ids, max_new, None, block_size=block)
    return [int(t) for t in out[0, len(prompt) :]]


def demo_vs_reference(
    decoder: BatchDecoder, ref_drafter: Any, prompts: Sequence[list[int]], max_new: int, block: int, repeats: int
) -> dict[str, Any]:
    """Tokens/s of our loop and of `dflash_generate` on the same prompts, one after the other per prompt (the
    order alternating), `repeats` times; whether the tokens are the same (greedy: both must be the target's)."""
    config = GenerationConfig(max_new_tokens=max_new, block_size=block)
    model = decoder.target.model  # type: ignore[attr-defined]
    secs: dict[str, list[float]] = {"ours": [], "reference": []}
    toks: dict[str, list[int]] = {"ours": [], "reference": []}
    same = True
    for rep in range(repeats):
        for i, p in enumerate(prompts):
            got: dict[str, list[int]] = {}
            order = ["ours", "reference"] if (i + rep) % 2 == 0 else ["reference", "ours"]
            for name in order:
                t0 = time.perf_counter()
                if name == "ours":
                    got[name] = decoder.generate([p], config)[0].token_ids
                else:
                    got[name] = reference_generate(ref_drafter, model, p, max_new, block)
                secs[name].append(time.perf_counter() - t0)
                toks[name].append(len(got[name]))
            n = min(len(got["ours"]), len(got["reference"]))
            same = same and got["ours"][:n] == got["reference"][:n]
    tps = {k: sum(toks[k]) / sum(secs[k]) for k in secs}
    return {
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "speedup": round(tps["ours"] / tps["reference"], 3),
        "same_tokens": same,
        "prompts": len(prompts),
        "repeats": repeats,
    }


def loop_host(
    decoder: BatchDecoder, prompts: Sequence[list[int]], c: int, max_new: int, block: int | None
) -> dict[str, float]:
    """Median ms per step of the loop on its real engines with `c` rows (prompts taken in turn), steady steps
    only (no prefill in them): the drafter's pass, the target's pass and the host work (policy, acceptance,
    commits, rollbacks, detokenizing, stop checks: the step's time outside the two passes)."""
    config = GenerationConfig(max_new_tokens=max_new, block_size=block)
    for i in range(c):
        decoder.add(prompts[i % len(prompts)], config)
    parts: dict[str, list[float]] = {"draft": [], "verify": [], "host": [], "policy": [], "accept": [], "step": []}
    while decoder.active:
        p = decoder.step().profile
        if p.prefill_rows or p.verify_rows < c:
            continue  # a step with a prefill in it, or after a row finished: not the steady batch
        parts["draft"].append(p.draft_s)
        parts["verify"].append(p.verify_s)
        parts["policy"].append(p.policy_s)
        parts["accept"].append(p.accept_s)
        parts["host"].append(p.total_s - p.draft_s - p.verify_s)
        parts["step"].append(p.total_s)
    return {k: round(1e3 * statistics.median(v), 3) for k, v in parts.items() if v}


class _EngineTimer:
    """CPU seconds of this thread spent inside a session's pass method (the fake engines' own Python, not the
    loop's)."""

    def __init__(self, session: Any, method: str):
        self.seconds = 0.0
        inner = getattr(session, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - t0

        setattr(session, method, timed)


def sim_host(c: int, steps: int, policy: str = "adaptive", seed: int = 0) -> dict[str, float]:
    """Host ms per step of the loop with `c` rows on the simulator's engines (sim/engines.py: no model runs;
    their virtual clock is priced by Vidur's A100 profile so that the policy has a cost model to choose by).
    Median over `steps` steady steps of (the step's CPU time - CPU time inside the fake engines), in CPU time of
    this thread rather than wall time, so that other processes on a shared machine do not count; the policy's
    own share beside it. Rows are long enough that none finishes while timed."""
    from ..sim.cost import ProfileCost
    from ..sim.engines import sim_engines
    from ..sim.policies import TimedPolicy, sim_decoder
    from ..sim.serving import GREEDY, workload

    work = workload("paper", prompt_len="fixed:256")
    target, drafter, clock = sim_engines(ProfileCost(), work.profiles)
    dec = sim_decoder(policy, target, drafter, clock, work.profiles, max(c, 8))
    fwd = _EngineTimer(dec.target_session, "forward")
    drf = _EngineTimer(dec.drafter_session, "draft")
    config = GenerationConfig(max_new_tokens=16 * (steps + 8), sampling=GREEDY, stop_token_ids=())
    for prompt, _, _ in work.requests(c, seed):
        dec.add(prompt, config)
    dec.step()  # the prefill
    dec.step()
    timed = cast(TimedPolicy, dec.policy)
    host: list[float] = []
    policy_ms: list[float] = []
    for _ in range(steps):
        engines, cpu = fwd.seconds + drf.seconds, timed.cpu_s
        t0 = time.thread_time()
        dec.step()
        cpu_s = time.thread_time() - t0
        host.append(1e3 * (cpu_s - (fwd.seconds + drf.seconds - engines)))
        policy_ms.append(1e3 * (timed.cpu_s - cpu))
    return {"host_ms": round(statistics.median(host), 4), "policy_ms": round(statistics.median(policy_ms), 4)}


# ---- the benchmark: `make bench-parts` ------------------------------------------------------
def _table(title: str, head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = [title, "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def run_engines(args: Any, decoder: BatchDecoder, ref_drafter: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Our passes beside the reference's at each C, and the loop's own split of a step at each C."""
    from ..runtime.torch_backend import TorchDrafterEngine, TorchTargetEngine

    target, drafter = decoder.target, decoder.drafter
    assert isinstance(target, TorchTargetEngine) and isinstance(drafter, TorchDrafterEngine)
    context = [t for p in prompts for t in p][: args.context]  # held-out text, as long as asked
    out: dict[str, Any] = {"context_tokens": len(context), "block": args.block, "passes": {}, "loop": {}}
    for c in args.rows:
        out["passes"][c] = engine_parts(target, drafter, ref_drafter, context, c, args.block, args.reps)
        out["loop"][c] = loop_host(decoder, prompts, c, args.max_new_tokens, args.block)
    return out


def report(results: dict[str, Any]) -> str:
    e = results["engines"]
    rows = []
    for c, p in e["passes"].items():
        ours, ref = p["ours"], p["reference"]
        rows += [
            [c, part, ours[part], ref[part], round(ours[part] / ref[part], 2)] for part in ("step", "verify", "draft")
        ]
    text = [
        _table(
            f"Passes, ms (median; context {e['context_tokens']}, block {e['block']})",
            ["C", "pass", "ours", "reference", "ours / ref"],
            rows,
        )
    ]
    loop = [[c, s["draft"], s["verify"], s["host"], s["policy"], s["accept"]] for c, s in e["loop"].items()]
    text.append(
        _table(
            "The loop on the demo pair, ms per steady step (median)",
            ["C", "draft", "verify", "host", "of it policy", "of it acceptance"],
            loop,
        )
    )
    sim = [[c, s["host_ms"], s["policy_ms"]] for c, s in results["sim_host"].items()]
    text.append(_table("Host work on zero-cost engines, ms per step (median)", ["C", "host", "of it policy"], sim))
    if "demo" in results:
        d = results["demo"]
        text.append(
            f"Demo (C=1, block {e['block']}, {d['prompts']} held-out prompts x {d['repeats']}): ours "
            f"{d['tokens_per_s']['ours']} tok/s, reference {d['tokens_per_s']['reference']} tok/s, "
            f"{d['speedup']}x, same tokens: {d['same_tokens']}"
        )
    return "\n\n".join(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`dflash-trt bench parts`'s flags."""
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32], help="C values for the engine passes")
    p.add_argument("--sim-rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256], help="C values, host alone")
    p.add_argument("--block", type=int, default=8, help="block size of verify and draft (default 8)")
    p.add_argument("--context", type=int, default=160, help="tokens the rows hold before the timed passes")
    p.add_argument("--reps", type=int, default=15, help="timed samples per pass (median; default 15)")
    p.add_argument("--sim-steps", type=int, default=30, help="timed steps per C on the zero-cost engines")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (loop and demo)")
    p.add_argument("--demo-prompts", type=int, default=10, help="held-out functions for the demo (0: skip it)")
    p.add_argument("--demo-repeats", type=int, default=2, help="passes over the demo prompts (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: a shared machine)")
    p.add_argument("--skip-engines", action="store_true", help="only the host alone (no models needed)")
    p.add_argument("--out", default="results/parts/results.json", help="the JSON written")


def run(args: argparse.Namespace) -> int:
    import json
    import platform
    import warnings
    from pathlib import Path

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*past_key_values.*")  # transformers' rename notice, per call
    out = Path(args.out)
    # a partial run (--skip-engines) keeps the other sections of an earlier one
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    results["machine"] = {"cpu": platform.processor() or platform.machine(), "threads": args.threads}
    results["torch"] = torch.__version__
    if not args.skip_engines:
        from ..loading import load_decoder
        from .prompts import held_out_function_prompts

        decoder = load_decoder(args.target, args.drafter)
        ref = load_reference_drafter(args.drafter)
        prompts = [decoder.encode(p.text) for p in held_out_function_prompts(max(args.demo_prompts, 8))]
        results["engines"] = run_engines(args, decoder, ref, prompts)
        if args.demo_prompts:
            demo_vs_reference(decoder, ref, prompts[:1], 32, args.block, 1)  # warm-up
            results["demo"] = demo_vs_reference(
                decoder, ref, prompts[: args.demo_prompts], args.max_new_tokens, args.block, args.demo_repeats
            )
    results["sim_host"] = {c: sim_host(c, args.sim_steps) for c in args.sim_rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    if "engines" in results:
        print(report(results))
    print(f"wrote {out}")
    return 0
