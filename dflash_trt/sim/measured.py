"""The measured inputs the package reads at run time, resolved here and nowhere else.

results/ is output only: what the benchmarks write, for people to read. Two of those measurements are also
inputs of the code, and live with the data under data/measured/, each a JSON file holding the sections of the
benchmark's results.json that the code reads (the same keys, so a results.json is a valid input too) and a
"source" that says which benchmark measured it:

  * HOST_STEP (`host-step.json`): `make bench-parts`' "sim_host", the serving loop's host work per step at C
    rows (sim.serving.host_step_s prices every simulated step with it);
  * DEMO_LOAD (`demo-load.json`): `make bench-load`'s in-process figures of the demo pair (per-prompt tau at
    block 8, the CPU cost grid, the step profile, engines-alone tokens/s) and its settings: `dflash-trt plan
    --profile demo` and the simulator's CPU calibration read them;
  * SUFFIX_TRACE (`suffix-trace.json`): the suffix proposer's rounds on the demo pair per workload
    (`dflash-trt bench suffix-trace` writes it whole, not from a results.json): the simulator replays its
    suffix matches from them (sim/suffix.py).

A benchmark run does not change them by itself (a run on a busy machine would silently move every simulated
figure): `dflash-trt bench measured-inputs NAME RESULTS.json` copies a run's sections here, and the commit that
does it says why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..settings import REPO_ROOT

DATA_DIR = REPO_ROOT / "data" / "measured"
HOST_STEP = DATA_DIR / "host-step.json"
DEMO_LOAD = DATA_DIR / "demo-load.json"
SUFFIX_TRACE = DATA_DIR / "suffix-trace.json"

# name -> (file, the benchmark that measures it, the sections of its results.json the code reads)
INPUTS: dict[str, tuple[Path, str, tuple[str, ...]]] = {
    "host-step": (HOST_STEP, "make bench-parts (dflash-trt bench parts)", ("sim_host", "machine", "torch")),
    "demo-load": (DEMO_LOAD, "make bench-load (dflash-trt bench load)", ("settings", "in_process")),
    "suffix-trace": (SUFFIX_TRACE, "dflash-trt bench suffix-trace", ("source", "workloads")),
}


def read(path: Path, name: str) -> dict[str, Any]:
    """The JSON object at `path` (the input `name`'s file unless a caller gives another); FileNotFoundError
    names the benchmark that measures it."""
    if not path.exists():
        made_by = INPUTS[name][1]
        raise FileNotFoundError(
            f"{path}: the measured input is missing; {made_by} measures it and `dflash-trt bench measured-inputs` copies it here"
        )
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def promote(name: str, results: Path) -> Path:
    """Copy the sections the code reads from a benchmark's `results` (its results.json) into the named input."""
    if name not in INPUTS:
        raise ValueError(f"unknown measured input {name!r}: one of {sorted(INPUTS)}")
    path, made_by, keys = INPUTS[name]
    doc = json.loads(results.read_text())
    missing = [k for k in keys if k not in doc]
    if missing:
        raise ValueError(f"{results} lacks {', '.join(missing)}: not a results.json of {made_by}")
    out = {
        "source": f"{made_by}, copied from its results.json by dflash-trt bench measured-inputs",
        **{k: doc[k] for k in keys},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    return path
