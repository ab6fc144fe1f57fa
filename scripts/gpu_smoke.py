"""`make gpu-smoke`: one command for a GPU node. Each part prints PASS, FAIL or SKIP (with the reason) and a summary.

  1. PyTorch engines on CUDA: DFlash greedy output == the same target engine alone (block size 1), exactly in
     float32 (see below for half precision); tau and speedup over the target alone; agreement with Hugging Face generate() is reported, not required.
  2. Engines (`dflash-trt engines`): the drafter's ONNX graph and TensorRT plan, the TensorRT-LLM target (TP ranks),
     built where tensorrt / tensorrt_llm and GPUs exist. At TP > 1 a target whose attention heads do not split
     into TP ranks (the demo target: 5 query / 1 KV heads) is replaced by a tiny random pair with 8 / 2 heads.
  3. The built engines through `dflash-trt generate --engines` (under `mpirun -n TP` when TP > 1): greedy output ==
     the same engines with --no-draft; tau and speedup over them; agreement with the Hugging Face target in
     float32 is a reported figure (an fp16 engine and an fp32 model part at near-ties, so it cannot be a pass
     condition).

Where equality is judged: exactly for float32 (PyTorch engines with TF32 off; --engine-precision fp32). In half
precision a verify pass of n tokens and a pass of one token run different GEMM, attention and (at tp > 1)
all-reduce sizes, so their reduction orders differ and a near-tie between the top two tokens may flip: there the
first divergence passes only where the target's top-2 logit margin at that position (the common prefix through
the target: the PyTorch model in the engine's dtype, or the float32 checkpoint for built engines) is below
NEAR_TIE_SPREAD x the standard deviation of those logits, and is reported with its margin; any other divergence
fails. The tiny random pair that stands in at tp > 1 is built at --engine-precision like any target (fp16 by
default) and judged the same way: an fp32 TensorRT-LLM engine runs unfused context attention, on which KV block
reuse is wrong, so it is built without reuse (dflash_trt/builders/trtllm_target.py) and would not exercise the
reuse path that serving runs.

    python scripts/gpu_smoke.py [--target DIR --drafter DIR] [--tp N] [--dtype float32] [--engine-precision fp16]

Exit status 1 when a part FAILS. Skipped parts (no GPU, no tensorrt, no tensorrt_llm, too few GPUs) do not fail
where the Python has no tensorrt_llm; where it has (a TensorRT-LLM container: `make gpu-smoke` picks its Python)
every part should run, so a skipped part is counted as FAILED with its reason. On a CPU machine without
tensorrt_llm every part is skipped with its reason (tests/bench/test_gpu_smoke.py checks that). NOT RUN on a GPU
in this project: no GPU was available to it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef walk(path):\n"]
# A half-precision divergence is a near-tie when the target's top two logits lie closer than this fraction of the
# standard deviation of its logits at that position. fp16 keeps 11 significant bits: one rounding moves a logit by
# up to 2^-11 of its magnitude, top logits stand about 10 standard deviations out, and the two passes being
# compared round differently in each of tens of layers, so a few hundredths of a standard deviation apart is a tie
# that reduction order decides. Scaled to the spread, not a fixed 0.1: beside a tiny random pair's logits
# (standard deviation ~0.3) a fixed 0.1 let most real faults pass as near-ties.
NEAR_TIE_SPREAD = 0.05


class Report:
    """PASS / FAIL / SKIP lines. strict (the Python has tensorrt_llm: a TensorRT-LLM container): every part
    should run there, so a skip is recorded as a FAIL with its reason."""

    def __init__(self, strict: bool = False) -> None:
        self.rows: list[tuple[str, str, str]] = []
        self.strict = strict

    def add(self, status: str, part: str, detail: str) -> None:
        if status == "SKIP" and self.strict:
            status, detail = "FAIL", f"skipped where tensorrt_llm is installed, so it should run: {detail}"
        self.rows.append((status, part, detail))
        print(f"{status:4} {part}: {detail}", flush=True)

    @property
    def failed(self) -> bool:
        return any(s == "FAIL" for s, _, _ in self.rows)


def environment() -> dict:
    import importlib.util

    import torch

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    env["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(env["gpus"])]
    for pkg in ("tensorrt", "tensorrt_llm", "transformers"):
        if importlib.util.find_spec(pkg) is None:
            env[pkg] = None
            continue
        from importlib.metadata import PackageNotFoundError, version

        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            env[pkg] = "installed"
    return env


def prompts_ids(decoder, n: int) -> list[list[int]]:
    if decoder.tokenizer is None:
        return [[1, 2, 3, 4], [5, 6, 7]][:n]
    return [decoder.encode(p) for p in PROMPTS[:n]]


def pytorch_stage(
    report: Report, target: Path, drafter: Path, device: str, dtype: str, max_new: int, n_prompts: int = 3
) -> None:
    """DFlash vs the target alone vs HF generate() with the PyTorch engines on `device`."""
    import torch

    from dflash_trt.decoding import GenerationConfig
    from dflash_trt.loading import load_decoder
    from dflash_trt.runtime.torch_backend import TorchTargetEngine

    part = f"pytorch engines on {device} ({dtype})"
    torch.backends.cuda.matmul.allow_tf32 = False  # equality is checked at full precision
    decoder = load_decoder(target, drafter, dtype, device)
    assert isinstance(decoder.target, TorchTargetEngine)  # load_decoder's engines are PyTorch's
    model = decoder.target.model
    spec_s = base_s = 0.0
    taus, results, agree = [], [], []
    for ids in prompts_ids(decoder, n_prompts):
        decoder.generate([ids], GenerationConfig(max_new_tokens=4))  # warm-up (CUDA context, kernels)
        t0 = time.perf_counter()
        [spec] = decoder.generate([ids], GenerationConfig(max_new_tokens=max_new))
        t1 = time.perf_counter()
        [alone] = decoder.generate([ids], GenerationConfig(max_new_tokens=max_new, block_size=1))
        t2 = time.perf_counter()
        with torch.inference_mode():
            x = torch.tensor([ids], device=model.device)
            hf = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        spec_s, base_s = spec_s + t1 - t0, base_s + t2 - t1
        taus.append(spec.stats.mean_acceptance_length)
        ok, note = judge(  # the lossless claim: exact in float32, up to near-ties in half precision
            spec.token_ids,
            alone.token_ids,
            dtype == "float32",
            lambda i, ids=ids, alone=alone: top2_margin(model, ids + alone.token_ids[:i]),
        )
        results.append((ids, ok, note))
        agree.append(agreement(alone.token_ids, hf))
    tau = sum(taus) / len(taus)
    detail = (
        f"tau {tau:.2f}, speedup {base_s / spec_s:.2f}x over the target alone ({len(taus)} prompts, {max_new} "
        f"tokens); {hf_figure(agree)}"
    )
    ok, verdict = verdicts(results, "the same target alone", "the same target alone")
    report.add("PASS" if ok else "FAIL", part, f"{verdict}; {detail}")


def top2_margin(model, ids: list[int]) -> tuple[float, float]:
    """(the gap between the two largest next-token logits of `model` after `ids`, the standard deviation of
    those logits), in float32 arithmetic on its output."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1]), float(logits.std())


def judge(spec: list[int], alone: list[int], exact: bool, margin_at) -> tuple[bool, str]:
    """(pass, what happened) for a speculative output against the same engine alone. exact: any difference fails.
    Otherwise the first divergence passes when margin_at(position) gives a top-2 margin below NEAR_TIE_SPREAD x
    the logits' standard deviation (a near-tie; later tokens follow different contexts and are not compared)."""
    if spec == alone:
        return True, "identical"
    first, _ = agreement(spec, alone)
    if exact:
        return False, f"differs at token {first}"
    margin, spread = margin_at(first)
    limit = NEAR_TIE_SPREAD * spread
    if margin < limit:
        return True, f"parts at token {first} at a near-tie (top-2 margin {margin:.4f} < {limit:.4f})"
    return False, f"differs at token {first}, top-2 margin {margin:.4f} >= {limit:.4f}: not a near-tie"


def verdicts(results: list[tuple[list[int], bool, str]], same: str, other: str) -> tuple[bool, str]:
    """One line for all prompts: (all passed, text)."""
    failed = [f"prompt {ids[:8]}: {note}" for ids, ok, note in results if not ok]
    ties = [f"prompt {ids[:8]}: {note}" for ids, ok, note in results if ok and note != "identical"]
    if failed:
        return False, f"greedy output differs from {other} ({'; '.join(failed)})"
    return True, f"greedy output == {same}" + (f" up to near-ties ({'; '.join(ties)})" if ties else "")


def agreement(ours: list[int], reference: list[int]) -> tuple[int, int]:
    """(tokens before the first difference, tokens compared): how far two greedy outputs agree."""
    n = min(len(ours), len(reference))
    same = next((i for i in range(n) if ours[i] != reference[i]), n)
    return same, n


def hf_figure(agree: list[tuple[int, int]]) -> str:
    """The Hugging Face agreement figure: identical prompts, and the common prefix over all tokens compared."""
    identical = sum(1 for same, n in agree if same == n)
    same, total = sum(a for a, _ in agree), sum(n for _, n in agree)
    return f"agrees with Hugging Face generate() on {identical}/{len(agree)} prompts ({same}/{total} tokens before a difference)"


def engines_stage(report: Report, args, env: dict) -> Path | None:
    from dflash_trt.builders.engines import build_engines, read_config
    from dflash_trt.runtime.registry import unavailable_reason

    trt_reason = unavailable_reason("drafter", "tensorrt")
    llm_reason = unavailable_reason("target", "tensorrt_llm")
    if llm_reason is None and env["gpus"] < args.tp:
        llm_reason = f"TP={args.tp} needs {args.tp} GPUs, {env['gpus']} visible"
    if trt_reason and llm_reason:
        report.add("SKIP", "drafter TensorRT plan", trt_reason)
        report.add("SKIP", f"TensorRT-LLM target engine (tp {args.tp})", llm_reason)
        return None
    if llm_reason is None and args.tp > 1:
        tp_pair(args, report)
    overrides = {"target": args.target, "drafter": args.drafter, "output": args.out, "tp": args.tp}
    cfg = read_config(None, ROOT, {**overrides, "precision": args.engine_precision})
    t0 = time.perf_counter()
    try:
        manifest, build = build_engines(cfg)
    except Exception as e:  # noqa: BLE001 - a smoke test reports, it does not crash
        report.add("FAIL", "engines build", f"{type(e).__name__}: {e}")
        return None
    for name, why in build.skipped.items():
        report.add("SKIP", name, why)
    for name in build.built + build.unchanged:
        report.add("PASS", f"built {name}", f"in {args.out} ({time.perf_counter() - t0:.0f} s for the build)")
    return (
        args.out if "target_tensorrt_llm" in manifest["engines"] or "drafter_tensorrt" in manifest["engines"] else None
    )


def parse_generate_output(stdout: str) -> dict:
    """The result object of `dflash-trt generate --json` in a launcher's mixed stdout.

    Under `mpirun` TensorRT-LLM prints banners and log lines to stdout around it, and ranks may interleave, so
    the last stdout line is not necessarily ours: the result is the last line that parses as a JSON object with
    the keys generate --json always writes (token_ids, stats)."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "token_ids" in obj and "stats" in obj:
            return obj
    tail = stdout.strip().splitlines()[-3:]
    raise RuntimeError(f"no `generate --json` result in the output (last lines: {tail})")


def cli_generate(engines: Path, tp: int, ids: list[int], max_new: int, no_draft: bool) -> dict:
    from dflash_trt.builders.trtllm_target import launch_command

    argv = ["generate", "--input-ids", ",".join(map(str, ids)), "--max-new-tokens", str(max_new), "--json"]
    cmd = launch_command(engines, tp, argv + (["--no-draft"] if no_draft else []))
    i = cmd.index("dflash-trt")  # this interpreter's package, whatever dflash-trt is on PATH
    cmd[i : i + 1] = [sys.executable, "-m", "dflash_trt.cli"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed: {out.stderr.strip().splitlines()[-1:]}")
    return parse_generate_output(out.stdout)


def served_engines_stage(report: Report, args, engines: Path) -> None:
    import torch

    from dflash_trt.loading import load_decoder
    from dflash_trt.runtime.torch_backend import TorchTargetEngine

    manifest = json.loads((engines / "manifest.json").read_text())
    part = f"engines: drafter {manifest['serve']['drafter']}, target {manifest['serve']['target']} (tp {args.tp})"
    hf = load_decoder(args.target, None, "float32", "cuda" if torch.cuda.is_available() else "cpu")
    assert isinstance(hf.target, TorchTargetEngine)  # load_decoder's engines are PyTorch's
    results, taus, tps_spec, tps_base, agree = [], [], [], [], []
    exact = args.engine_precision == "fp32"
    try:
        for ids in prompts_ids(hf, 3):
            x = torch.tensor([ids], device=hf.target.model.device)
            with torch.inference_mode():
                ref = hf.target.model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )[0, len(ids) :].tolist()
            spec = cli_generate(engines, args.tp, ids, args.max_new_tokens, no_draft=False)
            base = cli_generate(engines, args.tp, ids, args.max_new_tokens, no_draft=True)
            ok, note = judge(  # the lossless claim, judged where it is defined (module docstring)
                spec["token_ids"],
                base["token_ids"],
                exact,
                lambda i, ids=ids, base=base: top2_margin(hf.target.model, ids + base["token_ids"][:i]),
            )
            results.append((ids, ok, note))
            agree.append(agreement(base["token_ids"], ref))
            taus.append(spec["stats"]["mean_acceptance_length"])
            tps_spec.append(spec["stats"]["tokens_per_second"])
            tps_base.append(base["stats"]["tokens_per_second"])
    except Exception as e:  # noqa: BLE001
        report.add("FAIL", part, f"{type(e).__name__}: {e}")
        return
    detail = (
        f"tau {sum(taus) / len(taus):.2f}, speedup {sum(tps_spec) / sum(tps_base):.2f}x over the same target "
        f"with --no-draft ({len(taus)} prompts); the engine {hf_figure(agree).replace('generate()', 'float32')}"
    )
    ok, verdict = verdicts(results, "the same engines with --no-draft", "the same engines with --no-draft")
    report.add("PASS" if ok else "FAIL", part, f"{verdict}; {detail}")


def tp_pair(args, report: Report) -> None:
    """At tp > 1, a target whose attention heads do not split into tp ranks cannot be built: use a tiny random
    pair with 8 query / 2 KV heads (splits at tp 1, 2, 4 and 8) instead, and say so."""
    from dflash_trt.builders.trtllm_target import heads_split

    cfg = json.loads((args.target / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    heads = int(text["num_attention_heads"])
    kv = int(text.get("num_key_value_heads") or heads)
    why = heads_split(heads, kv, args.tp)
    if why is None:
        return
    from dflash_trt.models.tiny import make_tiny_drafter, make_tiny_target

    root = args.out.parent / f"{args.out.name}-tiny-tp-pair"
    target = make_tiny_target(
        root / "target", vocab_size=512, layers=4, hidden=256, num_attention_heads=8, num_key_value_heads=2
    )
    make_tiny_drafter(target.config, root / "drafter", layers=1, block_size=8)
    # Its engines keep --engine-precision (fp16 by default): the half-precision engine is the one whose rounds reuse
    # KV blocks as serving does (an fp32 one is built without reuse, trtllm_target.py), and judge() accepts a
    # divergence only at a near-tie scaled to this pair's own logit spread (NEAR_TIE_SPREAD)
    report.add(
        "INFO",
        "tp pair",
        f"{args.target}: {why}; using a tiny random 8/2-head pair in {root} at tp {args.tp}, engines in "
        f"{args.engine_precision}",
    )
    args.target, args.drafter = root / "target", root / "drafter"


def main(argv: list[str] | None = None) -> int:
    from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=DEMO_TARGET, help="HF target checkpoint (default: the demo model)")
    p.add_argument("--drafter", type=Path, default=DEMO_DRAFTER, help="DFlash drafter (default: the demo drafter)")
    p.add_argument("--tp", type=int, choices=[1, 2, 4, 8], default=1, help="tensor-parallel size of the target engine")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="PyTorch engines on CUDA (default float32: greedy equality without half-precision ties)",
    )
    p.add_argument(
        "--engine-precision",
        choices=["fp16", "fp32"],
        default="fp16",
        help="built engines' precision (default fp16; fp32: their output must equal --no-draft's exactly)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=ROOT / ".cache" / "gpu-smoke-engines", help="engines folder")
    args = p.parse_args(argv)

    env = environment()
    report = Report(strict=env["tensorrt_llm"] is not None)
    print("environment: " + json.dumps(env), flush=True)
    if env["cuda"]:
        try:
            pytorch_stage(report, args.target, args.drafter, "cuda", args.dtype, args.max_new_tokens)
        except Exception as e:  # noqa: BLE001
            report.add("FAIL", "pytorch engines on cuda", f"{type(e).__name__}: {e}")
    else:
        report.add("SKIP", "pytorch engines on cuda", f"no CUDA GPU visible to torch {env['torch']}")
    engines = engines_stage(report, args, env)
    if engines is None:
        report.add("SKIP", "engines end to end (generate --engines)", "no TensorRT / TensorRT-LLM engine was built")
    else:
        served_engines_stage(report, args, engines)
    counts = {s: sum(1 for r in report.rows if r[0] == s) for s in ("PASS", "FAIL", "SKIP")}
    print(f"gpu-smoke: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
