"""Schemathesis (property-based testing from /openapi.json) against `dflash-trt serve` as a real process
on a real port: every operation, a fixed seed, a bounded number of examples each. The checks: no 5xx,
status codes, content types and bodies as documented, invalid requests rejected, valid ones accepted.

The models are tiny and their context short (64 tokens), so that any valid request is cheap. "Valid" has
one gap the schema cannot state: a prompt plus max_tokens that overflow the context, each within its own
bound. That 400 (code context_length_exceeded) is the only rejection of valid data accepted here.
"""

import pytest
import schemathesis
from helpers import make_tokenizer
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from dflash_trt.models.tiny import make_tiny_drafter, make_tiny_target
from dflash_trt.server.process import start_serve

CONTEXT = 64
EXAMPLES = 12  # per operation and phase: about a minute on two busy cores


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("schemathesis")
    tok = make_tokenizer(root / "target")
    target = make_tiny_target(root / "target", vocab_size=len(tok), layers=2, seed=1,
                              max_position_embeddings=CONTEXT)
    make_tiny_drafter(target.config, root / "drafter", layers=1, block_size=4, mask_token_id=tok.mask_token_id)
    proc, url = start_serve(["--target", str(root / "target"), "--drafter", str(root / "drafter"),
                             "--threads", "1", "--model-name", "tiny", "--default-max-tokens", "8"],
                            root / "serve.log", env={"DFLASH_TRT_API_KEY": ""})
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


CONFIG = {
    "seed": 20261130,
    "checks": {"positive_data_acceptance": {"enabled": False}},  # replaced by valid_requests_accepted
    "phases": {"examples": {"enabled": True}, "coverage": {"enabled": False}, "stateful": {"enabled": False}},
}


@pytest.fixture(scope="module")
def api(served):
    return schemathesis.openapi.from_url(served + "/openapi.json", config=SchemathesisConfig.from_dict(CONFIG))


schema = schemathesis.pytest.from_fixture("api")


@schemathesis.check
def valid_requests_accepted(ctx, response, case):
    """A request the schema calls valid gets a 2xx, or the one 400 it cannot foresee (see the docstring)."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code < 400:
        return None
    code = None
    try:
        code = response.json()["error"]["code"]
    except Exception:
        pass
    if response.status_code == 400 and code == "context_length_exceeded":
        return None
    raise AssertionError(f"a valid request was rejected: {response.status_code} {response.text[:300]}")


@schema.parametrize()
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_api_keeps_its_openapi_contract(case):
    case.call_and_validate(additional_checks=[valid_requests_accepted], timeout=60)
