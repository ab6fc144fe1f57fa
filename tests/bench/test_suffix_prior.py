"""`dflash-trt bench suffix-prior` (dflash_trt/bench/suffix_prior.py) on recorded outputs (`--reuse`, no model):
the replay marks a run token right exactly when the output went on that way, the table is of the constants as
coded, and the JSON holds what the printed table says."""

import json
import random

from dflash_trt.bench import suffix_prior as bench
from dflash_trt.cli import main as cli
from dflash_trt.decoding import proposers as P


def test_the_replay_marks_a_run_token_right_when_the_output_went_on_that_way():
    phrase = [11, 12, 13, 14, 15]
    # the prompt holds the phrase; the output repeats its first 3 tokens, then leaves it
    recs = bench.records({"prompt": [1, 2] + phrase + [3], "output": [11, 12, 13, 99, 98]})
    # after "... 3 11" the run is 12 13 14 15 ...: 12 right, 13 right, 14 wrong (the output said 99), the replay stops
    places = [(r[5], r[4]) for r in recs]
    assert (0, 1) in places and (1, 1) in places and (2, 0) in places
    assert all(right in (0, 1) for _, right in places)
    wrong_then_more = [
        i for i, r in enumerate(recs[:-1]) if r[4] == 0 and recs[i + 1][5] == r[5] + 1 and recs[i + 1][5] > 0
    ]
    assert not wrong_then_more  # nothing is recorded past a wrong token of the same run


def _samples(seed: int, n: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(40) for _ in range(60)]
        output = []
        while len(output) < 60:  # copies of prompt stretches, some broken early
            start = rng.randrange(50)
            output += prompt[start : start + rng.randint(2, 10)] + [rng.randrange(40)]
        out.append({"prompt": prompt, "output": output[:60]})
    return out


def test_a_reused_run_writes_the_held_out_table_of_the_coded_constants(tmp_path, capsys):
    reuse = tmp_path / "recorded.json"
    reuse.write_text(json.dumps({"outputs": {"code": _samples(1, 4), "prose": _samples(2, 4)}}))
    out = tmp_path / "out"
    argv = ["bench", "suffix-prior", "--reuse", str(reuse), "--out", str(out), "--rows", "2", "--long-prompt", "300"]
    assert cli(argv) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["coded"] == {"prior_half": P.PRIOR_HALF, "prior_weight": P.PRIOR_WEIGHT, "max_prior": P.MAX_PRIOR}
    printed = capsys.readouterr().out
    for kind in ("code", "prose"):
        got = result["kinds"][kind]
        held = [r for s in result["outputs"][kind][2:] for r in bench.records(s)]
        assert got["held_out_tokens"] == len(held) > 0
        assert sum(b["tokens"] for b in got["counts_as_coded"]) == len(held)
        # each bucket's observed share is the share of its held-out tokens that were right
        for b in got["counts_as_coded"]:
            lo, hi = (float(x) for x in b["bucket"].split("-"))
            inside = [r[4] for r in held if lo <= bench.predicted(r, *bench.CODED) < (hi if hi < 1 else 1.0001)]
            assert len(inside) == b["tokens"] and round(sum(inside) / len(inside), 3) == b["observed"]
        assert f"{kind}, held out: 2 texts, {len(held)} run tokens" in printed
    assert result["step_time"]["2"]["steps"] == 300
