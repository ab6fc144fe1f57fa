"""The `proposer` request field and the server's `--proposer` default on a real server (uvicorn on a free loopback
port, the tiny text pair): greedy output is the target's own with every proposer, `spec` says which proposer drafted
what, /metrics counts draft tokens per proposer and the live suffix automata, /openapi.json documents the field."""

import httpx
import pytest
from server_harness import metric, running_server, scrape, server_fixtures

from dflash_trt.decoding import BatchDecoder, GenerationConfig
from dflash_trt.decoding.proposers import PROPOSERS, REGISTRY

# whether a request's suffix runs are verified is a priced choice (the server's start-up cost grid, its steps'
# seconds): the engines are priced on a virtual clock, so the choice is the same on a busy machine
models, decoder, server = server_fixtures("server-proposers", priced=True)
PROMPT = [5, 6, 7, 8, 9, 10, 11] * 3  # repeats: suffix runs fire from the first round


@pytest.fixture(scope="module")
def reference(decoder):
    alone = BatchDecoder(decoder.target, tokenizer=decoder.tokenizer)
    return alone.generate([PROMPT], GenerationConfig(max_new_tokens=24))[0].token_ids


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_every_proposer_returns_the_targets_greedy_tokens(server, reference, proposer):
    before = scrape(server)
    body = {"input_ids": PROMPT, "max_tokens": 24, "temperature": 0, "proposer": proposer}
    got = httpx.post(server + "/generate", json=body, timeout=60).json()
    after = scrape(server)
    assert got["token_ids"] == reference
    spec = got["spec"]
    assert spec["proposer"] == proposer
    for name in ("dflash", "suffix"):
        labels = {"proposer": name}
        delta = metric(after, "dflash_spec_decode_num_draft_tokens_total", **labels) - metric(
            before, "dflash_spec_decode_num_draft_tokens_total", **labels
        )
        assert delta == spec["drafted_by"].get(name, 0)
        accepted = metric(after, "dflash_spec_decode_num_accepted_tokens_total", **labels) - metric(
            before, "dflash_spec_decode_num_accepted_tokens_total", **labels
        )
        assert accepted == spec["accepted_by"].get(name, 0)
    if REGISTRY[proposer].keeps_suffix:  # suffix runs fire on the repeats
        assert spec["drafted_by"].get("suffix", 0) > 0 and spec["suffix_states"] > 0
    elif REGISTRY[proposer].deterministic:  # a lookup of its own (ngram): its drafts fire on the repeats
        assert spec["drafted_by"].get(proposer, 0) > 0


def test_an_unknown_proposer_is_a_400(server):
    r = httpx.post(server + "/generate", json={"input_ids": [1, 2], "proposer": "eagle"}, timeout=30)
    assert r.status_code in (400, 422) and "proposer" in r.text


def test_the_field_is_in_the_openapi_document(server):
    doc = httpx.get(server + "/openapi.json", timeout=30).json()
    field = doc["components"]["schemas"]["GenerateRequest"]["properties"]["proposer"]
    assert "suffix" in str(field) and "hybrid" in str(field)


def test_the_servers_default_proposer_serves_requests_without_one(decoder, reference):
    with running_server(decoder, proposer="suffix") as (url, _):
        got = httpx.post(url + "/generate", json={"input_ids": PROMPT, "max_tokens": 24}, timeout=60).json()
        assert got["spec"]["proposer"] == "suffix" and got["token_ids"] == reference
        assert "dflash_suffix_states " in scrape(url)


def test_finished_outputs_are_kept_only_where_the_operator_shares_them(decoder, reference):
    """`serve --suffix-sharing` (ServerSettings.suffix_sharing): off by default, so a request matches its own
    tokens only and no finished output is kept; `all` keeps them for the next requests; `--suffix-shared-tokens 0`
    keeps none even then. (Who may share with whom: test_suffix_privacy.py.)"""
    from dflash_trt.cli.main import build_parser
    from dflash_trt.server.tenancy import SuffixSharing

    args = build_parser().parse_args(["serve", "--suffix-shared-tokens", "0", "--suffix-sharing", "all"])
    assert args.suffix_shared_tokens == 0 and args.suffix_sharing == SuffixSharing("all")
    assert build_parser().parse_args(["serve"]).suffix_sharing == SuffixSharing("off")
    body = {"input_ids": PROMPT, "max_tokens": 24}
    for settings in ({}, {"suffix_sharing": SuffixSharing("all"), "shared_suffix_tokens": 0}):
        with running_server(decoder, proposer="suffix", **settings) as (url, app):
            for _ in range(2):
                assert httpx.post(url + "/generate", json=body, timeout=60).json()["token_ids"] == reference
            assert app.state.server.decoder.shared_suffixes is None, settings
    with running_server(decoder, proposer="suffix", suffix_sharing=SuffixSharing("all")) as (url, app):
        httpx.post(url + "/generate", json=body, timeout=60)
        assert app.state.server.decoder.shared_suffixes.size > 1  # shared: finished outputs kept


def test_a_request_fixing_its_block_size_gets_dflash_from_a_hybrid_server(decoder, reference):
    """The hybrid server's requests that fix `block_size` and name no proposer get DFlash (seeded text stays
    reproducible, docs/api.md Seeds); naming one, or leaving the block size to the server, keeps the choice."""
    with running_server(decoder, proposer="hybrid") as (url, _):
        for extra, want in (
            ({"block_size": 4}, "dflash"),
            ({}, "hybrid"),
            ({"block_size": 4, "proposer": "hybrid"}, "hybrid"),
        ):
            got = httpx.post(url + "/generate", json={"input_ids": PROMPT, "max_tokens": 24, **extra}, timeout=60)
            assert got.json()["spec"]["proposer"] == want and got.json()["token_ids"] == reference, extra
