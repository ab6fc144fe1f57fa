"""Replace the adaptive runs of results/sim/full-checks with those of new scripts/bench_sim.py runs (--policies adaptive), for a
change that only adaptive sees (the other policies' runs stand); checks and README recomputed, NOTE appended to
the settings' note. It reads results/sim/full-checks/results.json whatever OUT is, and keeps its cells: a new run
with no cell there is dropped, an old adaptive run with no new one kept (both counted). Usage (from the
repository root):
    python scripts/sim/full_checks_merge.py OUT NOTE RUNS.json...
e.g. OUT results/sim/full-checks and RUNS results/sim/eb-prior/adaptive-*.json."""

import json
import sys
from pathlib import Path

from dflash_trt.sim.bench.checks import criteria
from dflash_trt.sim.bench.report import readme

out, note = Path(sys.argv[1]), sys.argv[2]
full = json.loads(Path("results/sim/full-checks/results.json").read_text())
new = [r for p in sys.argv[3:] for r in json.loads(Path(p).read_text())["runs"]]


def key(r):
    return (r["gpu"], r["model"], r["tp"], r["workload"], r["prefill"], r["concurrency"], r["policy"], r["seed"])


fresh = {key(r): r for r in new}
assert all(r["policy"] == "adaptive" for r in new)
old_adaptive = [r for r in full["runs"] if r["policy"] == "adaptive"]
missing = [key(r) for r in old_adaptive if key(r) not in fresh]
runs = [fresh.get(key(r), r) for r in full["runs"]]
dropped = len(set(fresh) - {key(r) for r in full["runs"]})
res = dict(full)
res["runs"] = runs
res["settings"] = dict(full["settings"], note=f"{full['settings']['note']} {note}")
res["checks"] = criteria(runs, None)
out.mkdir(parents=True, exist_ok=True)
(out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
(out / "README.md").write_text(readme(res).replace("![tokens/s vs concurrency](sim.png)\n\n", ""))
kept_at = sorted(set(k[5] for k in missing))
print(
    f"replaced {len(fresh) - dropped} adaptive runs; dropped {dropped} without a cell; kept {len(missing)} at C={kept_at}"
)
print("\n".join(f"{'PASS' if c['passed'] else 'FAIL'} {c['what']}: {c['figure']}" for c in res["checks"]))
