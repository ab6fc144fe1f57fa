"""The simulator's suffix drafting, replayed from recorded rounds (dflash_trt/sim/suffix.py, issue 55): the real
proposers choose on replayed matches, and the simulated target alone decides what is accepted."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt.sim.acceptance import AcceptanceProfile
from dflash_trt.sim.cost import ProfileCost
from dflash_trt.sim.engines import SEED_TOKENS, prompt_seed
from dflash_trt.sim.measured import SUFFIX_TRACE
from dflash_trt.sim.serving import RunResult, Workload, simulate
from dflash_trt.sim.suffix import Proposing, SuffixTrace, position_map, rounds_of

# the demo drafter's acceptance (tau about 2.5 at block 16, the 2.3-3.0 on these workloads)
DEMO = AcceptanceProfile.fit("demo", 2.5, 16)


def _work(output_tokens: int) -> Workload:
    return Workload("demo", (DEMO,), (1.0,), "uniform:200-400", f"fixed:{output_tokens}")


def _run(trace: SuffixTrace | None, proposer: str, output_tokens: int = 128, requests: int = 24) -> RunResult:
    work, proposing = _work(output_tokens), Proposing(proposer, trace if proposer != "dflash" else None)
    return simulate(
        ProfileCost(),
        work,
        "fixed-8",
        concurrency=4,
        requests=requests,
        warmup=0,
        proposing=proposing,
        keep_outputs=True,
    )


def test_position_map_reads_a_recorded_run_further_on():
    """A round of 3 drafts, 2 accepted, says: 3 offered (2 right) here, then 2 (1 right), then 1 (none right)."""
    rounds = [[0, 0], [3, 2], [2, 2]]
    assert position_map(rounds) == ((0, 0), (0, 0), (3, 2), (2, 1), (1, 0), (2, 2), (1, 1), (0, 0))
    assert len(position_map(rounds)) == 1 + sum(a + 1 for _, a in rounds)  # one entry per output token


@pytest.mark.parametrize(("name", "output_tokens"), [("rewrite", 128), ("long", 512)])
def test_replayed_suffix_acceptance_matches_the_trace(name, output_tokens):
    """A simulated suffix run's share of suffix rounds and accepted / drafted suffix tokens are the recorded
    requests' it followed (each simulated request follows one by its seed, over the recorded output length)."""
    trace = SuffixTrace.load(name)
    requests = 24
    followed = collections.Counter(
        prompt_seed(p[:SEED_TOKENS]) % len(trace.rounds) for p, _, _ in _work(output_tokens).requests(requests, 0)
    )
    runs = {i: [(d, a) for d, a in trace.rounds[i] if d] for i in followed}
    want_share = sum(w * len(runs[i]) for i, w in followed.items()) / sum(
        w * len(trace.rounds[i]) for i, w in followed.items()
    )
    want_acc = sum(w * sum(a for _, a in runs[i]) for i, w in followed.items()) / sum(
        w * sum(d for d, _ in runs[i]) for i, w in followed.items()
    )
    got = _run(trace, "suffix", output_tokens, requests).proposers
    share = got["suffix"]["rounds"] / sum(v["rounds"] for v in got.values())
    acc = got["suffix"]["accepted"] / got["suffix"]["drafted"]
    assert share == pytest.approx(want_share, abs=0.08)
    assert acc == pytest.approx(want_acc, abs=0.08)


def test_hybrid_beats_dflash_on_a_repeat_heavy_trace_and_equals_it_without_matches():
    """The real HybridProposer on replayed matches: faster than DFlash alone where the trace repeats (the recorded
    rewrite workload), the same run as DFlash alone where the trace never matched; greedy outputs the target's."""
    dflash = _run(None, "dflash")
    hybrid = _run(SuffixTrace.load("rewrite"), "hybrid")
    assert hybrid.outputs == dflash.outputs  # lossless: the simulated target's tokens either way
    assert hybrid.proposers["suffix"]["accepted"] > 0
    assert hybrid.tokens_per_s > 1.1 * dflash.tokens_per_s
    never = SuffixTrace.from_rounds("no-matches", [[[0, 0]] * 64] * 3)
    plain = _run(never, "hybrid")
    assert "suffix" not in plain.proposers
    assert plain.tokens_per_s == pytest.approx(dflash.tokens_per_s, rel=1e-9)
    assert plain.proposers == dflash.proposers


def test_a_suffix_proposer_needs_a_trace_and_a_trace_checks_its_rounds():
    with pytest.raises(ValueError, match="needs a suffix trace"):
        simulate(ProfileCost(), _work(16), "fixed-8", concurrency=1, requests=1, proposing=Proposing("hybrid"))
    with pytest.raises(ValueError, match="accepted more than it drafted"):
        SuffixTrace.from_rounds("bad", [[[1, 2]]])
    with pytest.raises(ValueError, match="holds no trace"):
        SuffixTrace.load("no-such-workload")


def test_the_recorded_trace_is_small_and_holds_the_workloads():
    doc = json.loads(SUFFIX_TRACE.read_text())
    assert SUFFIX_TRACE.stat().st_size < 32_000
    assert {"rewrite", "long"} <= set(doc["workloads"]) and "source" in doc


def test_the_planners_closed_loop_runs_the_hybrid_on_a_trace():
    """`plan`'s runs (tune.run -> serving.run_closed) take the same proposer and trace."""
    from dflash_trt.plan import tune

    def one(proposing: Proposing) -> RunResult:
        return tune.run(ProfileCost(), _work(128), tune.fixed(8), 4, 16, 0, 8, proposing=proposing)

    dflash, hybrid = one(Proposing()), one(Proposing("hybrid", SuffixTrace.load("rewrite")))
    assert hybrid.proposer == "hybrid" and hybrid.proposers["suffix"]["accepted"] > 0
    assert hybrid.tokens_per_s > 1.1 * dflash.tokens_per_s


def test_rounds_of_a_hybrids_trace_counts_its_dflash_rounds_as_no_match():
    trace = [
        {"proposer": "dflash", "drafted": [5, 6, 7], "accepted": 2},
        {"proposer": "suffix", "drafted": [1, 2], "accepted": 1},
        {"proposer": "none", "drafted": [], "accepted": 0},
    ]
    assert rounds_of(trace) == [[0, 0], [0, 0], [0, 0], [2, 1], [0, 0]]  # the DFlash round's 3 tokens: no match


def test_a_generate_trace_file_is_replayed(tmp_path):
    """`dflash-trt generate --json --trace --proposer suffix` on the demo pair, its output replayed as is."""
    prompt = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"
    cmd = [str(Path(sys.executable).parent / "dflash-trt"), "generate", "--prompt", prompt, "--max-new-tokens", "48"]
    out = subprocess.run(
        [*cmd, "--proposer", "suffix", "--json", "--trace"], check=True, capture_output=True, text=True
    )
    path = tmp_path / "generate.jsonl"
    path.write_text(out.stdout)
    recorded = json.loads(out.stdout)
    trace = SuffixTrace.resolve(str(path))
    assert len(trace.positions[0]) == 1 + sum(r["accepted"] + 1 for r in recorded["trace"])
    assert trace.rounds[0] == tuple((len(r["drafted"]), r["accepted"]) for r in recorded["trace"])
    hybrid, dflash = _run(trace, "hybrid", 48, 8), _run(None, "dflash", 48, 8)
    assert hybrid.outputs == dflash.outputs and hybrid.proposers["suffix"]["accepted"] > 0


def test_a_trace_is_replayed_out_of_sample_with_a_prior_from_other_prompts(tmp_path):
    """`--suffix-prior-from`: the replayed matches carry the match length fitted on another recording (here one
    whose runs all held), not the one fitted on the rounds being replayed; a trace file's workload is named
    FILE:WORKLOAD."""
    poor = SuffixTrace.from_rounds("poor", [[[4, 0], [0, 0], [4, 1]]])
    sound = SuffixTrace.from_rounds("sound", [[[4, 4], [4, 3], [4, 4]]])
    assert poor.match_length < sound.match_length
    out = poor.prior_from(sound)
    assert out.match_length == sound.match_length and out.positions == poor.positions and out.rounds == poor.rounds
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"workloads": {"sound": {"requests": [{"rounds": [[4, 4], [4, 3], [4, 4]]}]}}}))
    assert SuffixTrace.resolve(f"{path}:sound") == sound
