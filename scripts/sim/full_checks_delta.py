"""Per cell, new adaptive runs against the old and both against the tuned table. OLD is full-checks' results.json
from before merge.py put the new runs in it. Usage (from the repository root), e.g. for results/sim/eb-prior:
    git show c412238:results/sim/full-checks/results.json > /tmp/old.json
    python scripts/sim/full_checks_delta.py /tmp/old.json results/sim/eb-prior/adaptive-*.json"""

import collections
import json
import statistics
import sys
from pathlib import Path

full = json.loads(Path(sys.argv[1]).read_text())["runs"]


def key(r):
    return (r["gpu"], r["model"], r["tp"], r["workload"], r["prefill"], r["concurrency"])


old = {key(r) + (r["seed"],): r["tokens_per_s"] for r in full if r["policy"] == "adaptive"}
tt = collections.defaultdict(list)
for r in full:
    if r["policy"] == "tuned-table":
        tt[key(r)].append(r["tokens_per_s"])
cells = collections.defaultdict(list)
for p in sys.argv[2:]:
    for r in json.loads(Path(p).read_text())["runs"]:
        cells[key(r)].append((r["tokens_per_s"], old[key(r) + (r["seed"],)]))
print("| setup | workload | prefill | C | new / old adaptive (seeds) | old / tuned | new / tuned |")
print("|---|---|---|---|---|---|---|")
allr = []
for k in sorted(cells, key=lambda k: (k[0], k[1], k[3], k[4], k[5])):
    v = cells[k]
    r = [a / b for a, b in v]
    allr += r
    t = statistics.mean(tt[k]) if tt[k] else float("nan")
    print(
        f"| {k[0]} {k[1]} tp={k[2]} | {k[3]} | {k[4]} | {k[5]} | {statistics.mean(r):.3f}x ({min(r):.3f}-{max(r):.3f}) | {statistics.mean(b for _, b in v) / t:.3f}x | {statistics.mean(a for a, _ in v) / t:.3f}x |"
    )
print(
    "geomean new/old over",
    len(allr),
    "runs:",
    round(statistics.geometric_mean(allr), 4),
    "min",
    round(min(allr), 3),
    "max",
    round(max(allr), 3),
)
