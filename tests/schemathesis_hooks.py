"""Schemathesis hooks for tests/server/test_schemathesis.py (loaded through SCHEMATHESIS_HOOKS)."""

import schemathesis

from dflash_trt.server.structured import CONFLICT, INVALID_GRAMMAR, INVALID_TOOLS

UNFORESEEABLE_400 = ("context_length_exceeded", INVALID_GRAMMAR, CONFLICT, INVALID_TOOLS)


@schemathesis.check
def valid_requests_accepted(ctx, response, case):
    """A request the schema calls valid gets a 2xx, or one of the answers the schema cannot foresee: a
    prompt and max_tokens, each within its bound, that together overflow the context (400
    context_length_exceeded), GET /v1/models/{model} for a model that does not exist (404), a grammar that
    does not compile or admits no string (any JSON object is a valid `schema` field; 400 invalid_grammar), two
    ways to constrain one output (400 conflicting_fields), a tool choice its tools do not allow (400
    invalid_tools)."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code < 400:
        return None
    try:
        code = response.json()["error"]["code"]
    except Exception:
        code = None
    if (response.status_code, code) in ((404, "model_not_found"), *((400, c) for c in UNFORESEEABLE_400)):
        return None
    raise AssertionError(f"a valid request was rejected: {response.status_code} {response.text[:300]}")
