"""The bounds of the served model: checked once where a request is built, and written into /openapi.json.

The request models (schemas.py) are static; what depends on the loaded engines (token ids against the
vocabulary and the context, max_tokens / min_tokens against the context, block_size against the drafter's
trained size, logit_bias keys against the vocabulary) is `Limits`. `Limits.check` refuses a request outside
them with the error pydantic gives for the same bound (a `RequestValidationError`, answered by errors.py as
every other validation error), and `Limits.document` writes the same bounds into the OpenAPI document, both
from one table (`maxima`, `TOKEN_ID_FIELDS`), so the document and the check cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi.exceptions import RequestValidationError
from pydantic_core import PydanticKnownError

from .schemas import BIAS, REQUEST_MODELS, RequestBody

if TYPE_CHECKING:
    from ..decoding import BatchDecoder

TOKEN_ID_FIELDS = ("input_ids", "prompt")  # token-id lists: at most max_context ids, each in the vocabulary


@dataclass(frozen=True)
class Limits:
    """What the loaded engines accept."""

    max_context: int  # prompt + generated tokens, the target's context length
    vocab_size: int
    max_block_size: int  # the drafter's trained block size (1: no drafter)
    model_name: str

    @classmethod
    def from_decoder(cls, decoder: BatchDecoder, model_name: str) -> Limits:
        drafter = decoder.drafter
        return cls(
            max_context=decoder.target.max_context,
            vocab_size=decoder.target.vocab_size,
            max_block_size=drafter.block_size if drafter is not None else 1,
            model_name=model_name,
        )

    def maxima(self) -> dict[str, int]:
        """The integer fields the served model bounds: field -> the largest value it takes."""
        most_new = max(1, self.max_context - 1)  # at least one token of the context is the prompt's
        return {
            "max_tokens": most_new,
            "max_completion_tokens": most_new,
            "min_tokens": self.max_context,
            "block_size": self.max_block_size,
        }

    # ---- the check ----------------------------------------------------------------------
    def check(self, body: RequestBody) -> None:
        """Raise RequestValidationError (a 400) for each field the client sent beyond these limits.
        Defaults are not checked: the decoder clips or refuses them with the whole request in view."""
        sent = body.model_fields_set
        errors = [
            _le((name,), getattr(body, name), most)
            for name, most in self.maxima().items()
            if name in sent and getattr(body, name, None) is not None and getattr(body, name) > most
        ]
        errors += self._token_id_errors(body, sent)
        bias = body.logit_bias if "logit_bias" in sent else None
        outside = [k for k in (bias or {}) if int(k) >= self.vocab_size]
        if outside:
            message = f"Value error, token ids out of vocabulary (size {self.vocab_size}): {outside[:5]}"
            errors.append({"type": "value_error", "loc": ("body", "logit_bias"), "msg": message, "input": bias})
        if errors:
            raise RequestValidationError(errors)

    def _token_id_errors(self, body: RequestBody, sent: set[str]) -> list[dict[str, Any]]:
        for name in TOKEN_ID_FIELDS:
            ids = getattr(body, name, None) if name in sent else None
            if not isinstance(ids, list) or not ids or not isinstance(ids[0], int):
                continue  # text, or not sent
            if len(ids) > self.max_context:
                ctx = {"field_type": "List", "max_length": self.max_context, "actual_length": len(ids)}
                return [_error("too_long", (name,), ids, ctx)]
            largest = self.vocab_size - 1
            return [_le((name, i), t, largest) for i, t in enumerate(ids) if t > largest]
        return []

    # ---- the document -------------------------------------------------------------------
    def document(self, doc: dict[str, Any]) -> None:
        """Write these limits into the OpenAPI document's request schemas (in place)."""
        schemas = doc.get("components", {}).get("schemas", {})
        for model in REQUEST_MODELS:
            props = schemas.get(model.__name__, {}).get("properties", {})
            for name, most in self.maxima().items():
                for member in _members(props.get(name), "integer"):
                    member["maximum"] = most
            for name in TOKEN_ID_FIELDS:
                for member in _members(props.get(name), "array"):
                    if member.get("items", {}).get("type") == "integer":
                        member["maxItems"] = self.max_context
                        member["items"]["maximum"] = self.vocab_size - 1
            for member in _members(props.get("logit_bias"), "object"):
                member["patternProperties"] = {token_id_pattern(self.vocab_size - 1): BIAS}
            if "model" in props:
                props["model"]["enum"] = [self.model_name, None]


def _members(prop: dict[str, Any] | None, type_: str) -> Iterator[dict[str, Any]]:
    """The schemas of `prop` (itself, or each member of its anyOf) of JSON type `type_`."""
    for member in (prop or {}).get("anyOf", [prop] if prop else []):
        if member.get("type") == type_:
            yield member


def _error(kind: str, loc: tuple[str | int, ...], value: Any, ctx: dict[str, Any]) -> dict[str, Any]:
    """One error as pydantic reports it (type, location, its own message), located in the body."""
    known = PydanticKnownError(kind, ctx)  # type: ignore[arg-type]  # kind: one of pydantic's error types
    return {"type": kind, "loc": ("body", *loc), "msg": known.message(), "input": value, "ctx": ctx}


def _le(loc: tuple[str | int, ...], value: Any, most: int) -> dict[str, Any]:
    return _error("less_than_equal", loc, value, {"le": most})


def token_id_pattern(largest: int) -> str:
    """A regular expression for the decimal integers 0..largest (no leading zeros): logit_bias keys."""
    s = str(largest)
    parts = ["0"] + ["[1-9]" + "[0-9]" * (d - 1) for d in range(1, len(s))]
    for i, digit in enumerate(s):  # same length as `largest`: equal up to i, smaller at i, anything after
        lo, hi = (1 if i == 0 else 0), int(digit) - 1
        if hi >= lo:
            parts.append(s[:i] + f"[{lo}-{hi}]" + "[0-9]" * (len(s) - i - 1))
    parts.append(s)
    return "^(" + "|".join(dict.fromkeys(parts)) + ")$"
