"""`dflash-trt plan overlay`: a plan's trtllm-serve configuration and alert thresholds, made ready for a deployment.

`dflash-trt plan` writes trtllm-serve.yaml with the drafter folder of the machine it ran on (or none, without
--drafter) and plan.json with the two alert thresholds. A pod sees the checkpoints at its own mount: this step
writes, into an overlay folder (deploy/k8s/trtllm-serve*, deploy/slurm),

* trtllm-serve.yaml: the plan's, with speculative_config.speculative_model set to the drafter folder as the pod
  sees it (never a placeholder), checked against what llm_args.py at the pinned commit accepts
  (builders.trtllm_llm_args) before anything is applied;
* plan-alerts.env: `tau_floor` and `batch_above` from plan.json's `alerts`, which the overlay's kustomize
  replacements put into the PrometheusRule and the ScaledObject (no threshold is a constant in the YAML).

Both files are generated, never committed: an overlay without them does not render (kustomize names the missing
file), so no cluster ever gets a placeholder or another plan's thresholds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..builders.trtllm_llm_args import yaml_problems

FILES = ("trtllm-serve.yaml", "plan-alerts.env")
POD_DRAFTER = "/checkpoints/drafter"  # the checkpoints volume's mount in every overlay (deploy/README.md)
PLACEHOLDER = "DRAFTER"  # what vLLM's and SGLang's files of a plan without --drafter hold (plan/outputs.py)


class OverlayError(ValueError):
    pass


def filled(plan_dir: Path, drafter_path: str = POD_DRAFTER) -> tuple[str, str]:
    """(trtllm-serve.yaml, plan-alerts.env) for a plan folder; OverlayError says what is missing or refused."""
    import yaml

    from ..builders.trtllm_serve import to_yaml

    src, doc_path = plan_dir / "trtllm-serve.yaml", plan_dir / "plan.json"
    try:
        text, doc = src.read_text(), json.loads(doc_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise OverlayError(f"{plan_dir} is not a folder `dflash-trt plan --out` wrote: {e}") from None
    if not drafter_path.startswith("/") or PLACEHOLDER in drafter_path:
        raise OverlayError(f"--drafter-path {drafter_path!r}: the drafter folder as the pod sees it, an absolute path")
    loaded: dict[str, Any] = yaml.safe_load(text) or {}
    spec = loaded.get("speculative_config")
    if isinstance(spec, dict):
        spec["speculative_model"] = drafter_path
    problems = yaml_problems(loaded)
    if problems:
        raise OverlayError(f"{src}: trtllm-serve would refuse it: " + "; ".join(problems))
    comments = [line for line in text.splitlines() if line.startswith("#")]
    if isinstance(spec, dict):
        comments = [c for c in comments if "add speculative_model" not in c]
        comments.append("# speculative_model: the drafter as the pod mounts it (dflash-trt plan overlay)")
    yaml_text = "\n".join(comments) + "\n" + to_yaml(loaded)
    alerts = doc.get("alerts") or {}
    if not isinstance(alerts.get("batch_above"), int):
        raise OverlayError(f"{doc_path} has no alerts.batch_above: re-run `dflash-trt plan` (it writes `alerts`)")
    # no drafting concurrency: tau is not served, and a floor of 0 never fires
    tau_floor = alerts.get("tau_floor") or 0
    env = f"tau_floor={tau_floor}\nbatch_above={alerts['batch_above']}\n"
    return yaml_text, env


def write(plan_dir: Path, out: Path, drafter_path: str = POD_DRAFTER) -> list[Path]:
    yaml_text, env = filled(plan_dir, drafter_path)
    if not (out / "kustomization.yaml").is_file() and not out.is_dir():
        raise OverlayError(f"{out}: not a folder")
    paths = [out / name for name in FILES]
    for path, body in zip(paths, (yaml_text, env)):
        path.write_text(body)
    return paths
