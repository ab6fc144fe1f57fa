"""A server without a drafter (`serve --drafter none`) on a real uvicorn server: requests that name no proposer get
one that needs no drafter (the suffix proposer, in place of the server's hybrid) and the target's greedy output;
a request naming a proposer that uses the drafter is a 400 that says which proposers remain, unless it cannot
draft at all (block size 1: `serve --no-draft`)."""

import httpx
import pytest
from clocks import priced_decoder
from helpers import make_text_models
from server_harness import running_server

from dflash_trt.decoding import BatchDecoder, GenerationConfig
from dflash_trt.loading import load_decoder

PROMPT = [5, 6, 7, 8, 9, 10, 11] * 3  # repeats: suffix and ngram drafts fire from the first round


@pytest.fixture(scope="module")
def target_only(tmp_path_factory):
    target, _ = make_text_models(tmp_path_factory.mktemp("drafterless"))
    return load_decoder(target)  # no drafter


@pytest.fixture(scope="module")
def reference(target_only):
    alone = BatchDecoder(target_only.target, tokenizer=target_only.tokenizer)
    return alone.generate([PROMPT], GenerationConfig(max_new_tokens=24, block_size=1))[0].token_ids


def test_a_drafterless_server_drafts_without_a_drafter_and_refuses_the_drafters_proposers(target_only, reference):
    # priced on a virtual clock: whether a run is worth its verify tokens is a priced choice, which the machine's
    # load (or the adversarial clock's draws) must not decide
    with running_server(priced_decoder(target_only)) as (url, app):  # the server's default proposer: the hybrid
        assert app.state.server.decoder.drafter is None
        for proposer, want in ((None, "suffix"), ("suffix", "suffix"), ("ngram", "ngram")):
            body = {"input_ids": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            got = httpx.post(url + "/generate", json={**body, "proposer": proposer}, timeout=60).json()
            assert got["token_ids"] == reference and got["spec"]["proposer"] == want
            assert got["spec"]["drafted_by"].get(want, 0) > 0
        for proposer in ("dflash", "hybrid"):
            r = httpx.post(url + "/generate", json={"input_ids": PROMPT, "proposer": proposer}, timeout=60)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "proposer" and "has none" in error["message"] and "ngram" in error["message"]
            ok = httpx.post(url + "/generate", json={"input_ids": PROMPT, "proposer": proposer, "block_size": 1})
            assert ok.status_code == 200  # block 1: the target alone, nothing to draft with


def test_the_target_alone_server_serves_every_proposer_at_block_1(target_only, reference):
    with running_server(target_only, block_size=1) as (url, _):  # what `serve --no-draft` builds
        for proposer in ("dflash", "suffix"):
            body = {"input_ids": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "proposer": proposer}
            got = httpx.post(url + "/generate", json=body, timeout=60).json()
            assert got["token_ids"] == reference and got["spec"]["drafted_tokens"] == 0
