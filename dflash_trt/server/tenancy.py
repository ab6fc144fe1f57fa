"""Which requests share finished outputs for suffix drafting (`serve --suffix-sharing`): a request's tenant.

Sharing finished outputs across requests is an oracle of those outputs (decoding/sharing.py says how), so it is
off unless the operator names who may share, and then only within a tenant, a set of clients the operator trusts
to read each other's outputs:

    off            (the default) no request shares: each matches its own prompt and output only
    key            one tenant per API key (`--api-key-file` holds one key a line): clients holding the same key
                   share, clients of different keys never do; needs keys
    header:NAME    one tenant per value of the request header NAME, which the operator's gateway sets (and
                   overwrites: a client that reaches the server directly could name any tenant); a request
                   without it shares nothing
    all            every client is one tenant: a server whose clients are one party (a local agent); never a
                   server with clients that must not read each other's outputs

The tenant's name is never a key: a key's tenant is named by its place in the key list."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi import Request

SCOPES = ("off", "key", "header", "all")
# a header value longer than this names no tenant (nothing shared): a gateway's tenant ids are short
MAX_TENANT_CHARS = 256
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")  # an HTTP token (RFC 9110 5.1)


@dataclass(frozen=True)
class SuffixSharing:
    """Who shares finished outputs (the module's table); `header` is the header's name for scope "header"."""

    scope: str = "off"
    header: str | None = None

    @classmethod
    def parse(cls, text: str) -> SuffixSharing:
        """`off`, `key`, `all` or `header:NAME` (ValueError otherwise)."""
        scope, _, header = text.partition(":")
        if scope == "header":
            if not _HEADER_NAME.match(header):
                raise ValueError(f"header:NAME needs an HTTP header name, got {text!r}")
            return cls("header", header.lower())
        if scope not in SCOPES or header:
            raise ValueError(f"expected off, key, all or header:NAME, got {text!r}")
        return cls(scope)

    def __str__(self) -> str:
        return f"header:{self.header}" if self.scope == "header" else self.scope

    def check(self, keys: int) -> None:
        """ValueError where the scope cannot be served: `key` without API keys would make every client one
        tenant, which is `all`, and must be asked for by that name."""
        if self.scope == "key" and keys == 0:
            raise ValueError(
                "suffix sharing by key needs API keys (--api-key-file with one key a line); without keys every "
                "client would be one tenant: say --suffix-sharing all if that is meant"
            )

    def tenant(self, request: Request) -> str | None:
        """The request's tenant (None: it shares nothing). Key scope reads the key the API key check matched
        (`context.require_api_key` records its place)."""
        if self.scope == "all":
            return "all"
        if self.scope == "key":
            index = getattr(request.state, "api_key_index", None)
            return None if index is None else f"key-{index}"
        if self.scope == "header":
            assert self.header is not None
            value = request.headers.get(self.header, "")
            return f"header-{value}" if 0 < len(value) <= MAX_TENANT_CHARS else None
        return None
