"""`dflash-trt bench sim` (dflash_trt/cli/bench_sim.py over dflash_trt/bench/sim): the serving simulation's
benchmark driver, run as a user runs it, at its smoke size; its JSON, its policy and group choices, its refusals.
The simulator it drives is tested in tests/sim/."""

from __future__ import annotations

import json
import subprocess
import sys

from dflash_trt.settings import REPO_ROOT as ROOT
from dflash_trt.sim.policies import POLICIES, TUNED

BENCH_SIM = [sys.executable, "-m", "dflash_trt.cli", "bench", "sim"]


def test_smoke_run_writes_every_policys_cells_and_the_tuned_tables(tmp_path):
    out = tmp_path / "sim"
    subprocess.run(
        [*BENCH_SIM, "--smoke", "--out", str(out)],
        check=True,
        cwd=ROOT,
        timeout=120,
    )
    data = json.loads((out / "results.json").read_text())
    runs = data["runs"]
    assert runs
    keys = {"gpu", "model", "tp", "workload", "policy", "prefill", "concurrency", "tokens_per_s", "itl_p99_s"}
    for r in runs:
        assert keys <= set(r)
        assert r["policy"] in set(POLICIES + TUNED + ("optimum",)) and r["gpu"] in {"a100", "h100"}
        assert r["prefill"] in {"chunked", "separate"}
        if r["policy"] == "adaptive":
            # the steps that held C rows: a closed-loop cell always has some
            assert r["policy_cpu_s_per_steady_step"] > 0 and r["simulated_steady_step_s"] > 0
        if r["policy"] == "optimum":
            assert 0 <= r["optimum_gap"] < 0.1
    assert {r["policy"] for r in runs} >= {"tuned-table", "vllm-table", "optimum", "trtllm-schedule-threshold"}
    assert data["tuned_tables"]  # the tuned policies' tables, from the fixed blocks
    assert (out / "README.md").exists()


def test_it_runs_the_chosen_policies_and_groups_and_refuses_a_table_without_its_fixed_runs(tmp_path):
    script = [*BENCH_SIM, "--smoke", "--rates", "--calibrations"]
    bad = subprocess.run([*script, "--policies", "adaptive", "tuned-table"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "tuned from the fixed runs" in bad.stderr
    out = tmp_path / "sim"
    cmd = [*script, "--policies", "adaptive", "optimum", "--prefill-stall", "1.5", "--out", str(out)]
    subprocess.run([*cmd, "--groups", "h100:llama-2-7b:1:paper"], check=True, cwd=ROOT, timeout=120)
    data = json.loads((out / "results.json").read_text())
    assert {r["policy"] for r in data["runs"]} == {"adaptive", "optimum"}
    assert {(r["gpu"], r["model"], r["workload"]) for r in data["runs"]} == {("h100", "llama-2-7b", "paper")}
    assert data["settings"]["prefill_stall"] == 1.5 and "prefill-stall" in data["settings"]["mode"]


def test_it_runs_the_hybrid_on_a_recorded_trace(tmp_path):
    out = tmp_path / "sim"
    script = [*BENCH_SIM, "--smoke", "--rates", "--calibrations"]
    cmd = [*script, "--policies", "fixed-8", "--no-compare-prefill", "--out", str(out)]
    subprocess.run([*cmd, "--proposer", "hybrid", "--suffix-trace", "long"], check=True, cwd=ROOT, timeout=120)
    data = json.loads((out / "results.json").read_text())
    assert data["settings"]["proposer"] == "hybrid" and data["settings"]["suffix_trace"] == "long"
    assert all(r["proposer"] == "hybrid" and r["proposers"]["suffix"]["rounds"] > 0 for r in data["runs"])
    bad = subprocess.run([*cmd, "--proposer", "suffix", "--suffix-trace", "nope"], cwd=ROOT, capture_output=True)
    assert bad.returncode == 2 and b"holds no trace" in bad.stderr
