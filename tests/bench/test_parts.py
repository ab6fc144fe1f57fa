"""The round-parts benchmark (dflash_trt/bench/parts.py) times the same computation on both sides: the reference's
modules (z-lab's `dflash` package) and our engines give the same features and draft logits on the same shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_trt.bench import parts
from dflash_trt.runtime.base import DraftRequest
from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET

pytest.importorskip("dflash.model")


@pytest.fixture(scope="module")
def pair() -> tuple[object, object]:
    from dflash_trt.loading import load_decoder

    return load_decoder(DEMO_TARGET, DEMO_DRAFTER), parts.load_reference_drafter(str(DEMO_DRAFTER))


def test_reference_parts_compute_what_ours_do(pair: tuple[object, object]) -> None:
    decoder, ref = pair
    context = list(range(100, 148))
    ours = parts.OurParts(decoder.target, decoder.drafter, context, 2, 8)  # type: ignore[attr-defined]
    theirs = parts.ReferenceParts(decoder.target.model, ref, context, 2, 8)  # type: ignore[attr-defined]
    torch.testing.assert_close(ours.feats, theirs.feats[1])
    tail = ours.feats[-ours.new :]
    drafts = ours.ds.draft([DraftRequest(r, tail, int(ours.last), 8) for r in ours.drows])
    with torch.inference_mode():
        logits = ref.compute_logits(theirs._draft(theirs.feats[:, theirs.ctx :], theirs.ctx), theirs.head)  # type: ignore[attr-defined]
    for i, d in enumerate(drafts):
        torch.testing.assert_close(d.logits, logits[i], atol=1e-4, rtol=1e-4)
    # the timed passes leave both sides where they were, so every sample times the same shapes
    for timed in (ours.verify, ours.draft, theirs.verify, theirs.draft):
        timed()
    assert [ours.ts.length(r) for r in ours.rows] == [len(context)] * 2
    assert theirs.cache.get_seq_length() == len(context) and theirs.dcache.get_seq_length() == theirs.ctx


def test_demo_against_reference_same_tokens(pair: tuple[object, object]) -> None:
    decoder, ref = pair
    prompt = decoder.encode('def mean(values):\n    """Return the mean."""')  # type: ignore[attr-defined]
    got = parts.demo_vs_reference(decoder, ref, [prompt], 24, 8, 1)  # type: ignore[arg-type]
    assert got["same_tokens"] is True and got["tokens_per_s"]["ours"] > 0


def test_sim_host_is_the_loop_alone() -> None:
    got = parts.sim_host(4, steps=3)
    assert 0 < got["host_ms"] < 1000 and 0 <= got["policy_ms"] <= got["host_ms"]


def test_simulator_host_term_is_the_measured_curve(tmp_path: Path) -> None:
    from dflash_trt.sim import serving

    path = tmp_path / "results.json"
    path.write_text(json.dumps({"sim_host": {"1": {"host_ms": 0.5}, "64": {"host_ms": 2.0}, "256": {"host_ms": 5.0}}}))
    f = serving.CPU_TO_GPU_HOST * 1e-3
    assert serving.host_step_s(1, path) == pytest.approx(0.5 * f)
    assert serving.host_step_s(160, path) == pytest.approx(3.5 * f)  # linear between the measured rows
    assert serving.host_step_s(1000, path) == pytest.approx(5.0 * f)  # flat beyond them
    with pytest.raises(FileNotFoundError, match="make bench-parts"):
        serving.host_step_s(1, tmp_path / "missing.json")
