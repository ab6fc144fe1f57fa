"""The shared suffix structure as an oracle, replayed through a real server (uvicorn on a free loopback port, the
tiny text pair priced on a virtual clock): a victim's request finishes; an attacker who knows the start of its
output (`...password='`) sends that start as its prompt and forces one candidate next token with `logit_bias`, and
reads how many tokens the round after its first one drafted (the /generate stream's `drafted`). Where it shares
the victim's finished outputs the right candidate drafts the rest of the victim's output and the others draft
little: the secret is read a token at a time. The server must share only within a tenant the operator named
(server/tenancy.py): under the defaults and across tenants, the attacker sees exactly what it sees on a server the
victim never used, and the attack fails; within one tenant it succeeds (so this test can fail)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from server_harness import running_server, server_fixtures

from dflash_trt.decoding import BatchDecoder, GenerationConfig
from dflash_trt.server.tenancy import SuffixSharing

models, decoder, server = server_fixtures("suffix-privacy", priced=True)
log = logging.getLogger(__name__)

KNOWN = 6  # output tokens the attacker knows (the `password='` before the secret)
WRONG = 30  # wrong candidates probed beside the right one
VICTIM_TOKENS = 24
PROBE_TOKENS = 12


@pytest.fixture(scope="module")
def victim_prompt(decoder):
    """A prompt whose greedy output does not repeat in its first tokens: the known start + the secret and what
    follows are then new text, which only the victim's finished output can predict."""
    alone = BatchDecoder(decoder.target, tokenizer=decoder.tokenizer)
    for start in range(10, 200, 7):
        prompt = list(range(start, start + 12))
        out = alone.generate([prompt], GenerationConfig(max_new_tokens=VICTIM_TOKENS))[0].token_ids
        if len(set(out[: KNOWN + 8])) == KNOWN + 8:
            return prompt, out
    pytest.fail("no prompt of the tiny target gives a non-repeating output")


def _victim(url: str, prompt: list[int], headers: dict[str, str]) -> list[int]:
    body = {"input_ids": prompt, "max_tokens": VICTIM_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/generate", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


def _drafted_after_forcing(url: str, known: list[int], candidate: int, headers: dict[str, str]) -> int:
    """The attacker's probe: the known start as its prompt, `candidate` forced by logit_bias, suffix drafts; the
    tokens drafted in the round after its first token (what the stream tells every client)."""
    body = {
        "input_ids": known,
        "max_tokens": PROBE_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "proposer": "suffix",
        "logit_bias": {str(candidate): 100},
        "stream": True,
    }
    with httpx.stream("POST", url + "/generate", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        rounds = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    verified = [e for e in rounds if e["type"] == "round" and not e["prefill"]]
    return int(verified[0]["drafted"])


def _probe_all(url: str, known: list[int], candidates: list[int], headers: dict[str, str]) -> list[int]:
    return [_drafted_after_forcing(url, known, c, headers) for c in candidates]


def _reads_the_secret(drafted: list[int]) -> bool:
    """The attack's success: the right candidate (first) drafted more than every wrong one."""
    return drafted[0] > max(drafted[1:])


def _candidates(out: list[int], vocab: int) -> list[int]:
    secret = out[KNOWN]
    return [secret, *[t for t in range(3, vocab) if t != secret][:WRONG]]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_attack_reads_the_secret_within_a_tenant_and_nothing_across_tenants(decoder, victim_prompt):
    prompt, out = victim_prompt
    known, candidates = out[:KNOWN], _candidates(out, int(decoder.target.vocab_size))
    keys = ("victim-key", "other-key", "fresh-key")
    with running_server(decoder, api_keys=keys, suffix_sharing=SuffixSharing.parse("key")) as (url, _):
        before = _probe_all(url, known, candidates, _bearer("other-key"))  # the victim has not run yet
        assert _victim(url, prompt, _bearer("victim-key")) == out
        across = _probe_all(url, known, candidates, _bearer("fresh-key"))
        within = _probe_all(url, known, candidates, _bearer("victim-key"))
    log.info("drafted per candidate (right one first): before %s across %s within %s", before, across, within)
    print(f"\nkey tenants: before {before}\n  across tenants {across}\n  within the tenant {within}")
    assert across == before, "another tenant's probes saw the victim's output"
    assert not _reads_the_secret(across)
    assert _reads_the_secret(within), (
        f"the attack must work where sharing is on (else this test proves nothing): {within}"
    )


def test_the_attack_fails_under_the_defaults(decoder, victim_prompt):
    prompt, out = victim_prompt
    known, candidates = out[:KNOWN], _candidates(out, int(decoder.target.vocab_size))
    with running_server(decoder) as (url, app):
        assert app.state.server.settings.suffix_sharing.scope == "off"
        assert app.state.server.decoder.shared_suffixes is None  # nothing kept: nothing to read back
        before = _probe_all(url, known, candidates, {})
        assert _victim(url, prompt, {}) == out
        after = _probe_all(url, known, candidates, {})
    print(f"\ndefaults: before {before}\n  after the victim {after}")
    assert after == before and not _reads_the_secret(after)


def test_a_gateway_header_scopes_the_sharing(decoder, victim_prompt):
    """header:X-Tenant: the victim's gateway tenant shares with itself only; a request without the header shares
    nothing."""
    prompt, out = victim_prompt
    known, candidates = out[:KNOWN], _candidates(out, int(decoder.target.vocab_size))[:8]
    with running_server(decoder, suffix_sharing=SuffixSharing.parse("header:X-Tenant")) as (url, _):
        before = _probe_all(url, known, candidates, {"X-Tenant": "b"})
        assert _victim(url, prompt, {"X-Tenant": "a"}) == out
        across = _probe_all(url, known, candidates, {"X-Tenant": "c"})
        none = _probe_all(url, known, candidates, {})
        within = _probe_all(url, known, candidates, {"X-Tenant": "a"})
    print(f"\nheader tenants: before {before}\n  across {across}\n  no header {none}\n  within {within}")
    assert across == none == before and not _reads_the_secret(across)
    assert _reads_the_secret(within)


def test_sharing_by_key_without_keys_is_refused():
    with pytest.raises(ValueError, match="needs API keys"):
        from dflash_trt.server.app import ServerSettings

        ServerSettings(suffix_sharing=SuffixSharing.parse("key"))


@pytest.mark.parametrize("bad", ["on", "header:", "header:a b", "key:x"])
def test_a_sharing_scope_is_one_of_the_documented_ones(bad):
    with pytest.raises(ValueError, match="expected off|header name"):
        SuffixSharing.parse(bad)


def test_serve_reads_one_key_a_line_and_refuses_sharing_by_key_without_keys(tmp_path, monkeypatch):
    """`serve --api-key-file` with several keys (blank lines and comments skipped): each key a tenant; sharing by
    key with no key at all is refused before serving, as `all` must be asked for by name."""
    from dflash_trt.cli.main import build_parser
    from dflash_trt.cli.options import CliError
    from dflash_trt.cli.serve import API_KEY_ENV, API_KEY_FILE_ENV, _api_keys

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nfirst-key\n\n  second-key  \n")
    args = build_parser().parse_args(["serve", "--api-key-file", str(keys), "--suffix-sharing", "key"])
    decoder = BatchDecoder.__new__(BatchDecoder)  # nothing loaded: _api_keys closes the engines only on an error
    assert _api_keys(args, decoder) == ("first-key", "second-key")
    bare = build_parser().parse_args(["serve", "--suffix-sharing", "key"])
    monkeypatch.setattr("dflash_trt.cli.options.close_engines", lambda d: None)
    with pytest.raises(CliError, match="--suffix-sharing key: suffix sharing by key needs API keys"):
        _api_keys(bare, decoder)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--suffix-sharing", "everyone"])
