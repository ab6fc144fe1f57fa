"""Who shares finished outputs with whom: one shared suffix structure (`suffix.SharedSuffixes`) per tenant, never
one across tenants.

A request's suffix runs may also match the outputs of earlier requests (an agent's next turn resends what it
received). That makes every later request an oracle of the earlier outputs: a client that forces a guessed
continuation (its prompt, `logit_bias`) sees from the tokens drafted for it, or from how fast its tokens come,
whether some earlier output went on that way, one guessed token at a time. Hiding the drafted counts would not
close it (a round that drafts 6 accepted tokens also arrives 6 tokens at once). So the outputs a request may match
are those of its own tenant only: a set of clients the operator trusts to read each other's outputs (one API key,
one value of a header its gateway sets). A request without a tenant (`GenerationConfig.tenant` None, the default)
matches its own tokens only and leaves nothing behind.

Bounded: each tenant's structure holds at most `max_tokens` tokens, and at most `max_tenants` tenants keep one (the
least recently used is dropped past that: its later requests start from nothing, as a new tenant's do)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from .suffix import SharedSuffixes

# Tenants whose finished outputs are kept at once (each up to the decoder's shared-token bound): enough for the API
# keys of a small deployment; past it the least recently served tenant's outputs are dropped.
MAX_TENANTS = 16


class TenantSuffixes:
    """The shared suffix structures of a decoder's tenants. `of` is called from any thread (a row is made in an
    HTTP handler's); the structures themselves are read and grown in the loop's thread only."""

    def __init__(self, max_tokens: int, max_tenants: int = MAX_TENANTS):
        if max_tenants < 1:
            raise ValueError(f"at least one tenant's outputs must fit, got max_tenants={max_tenants}")
        SharedSuffixes(max_tokens)  # the bound's own check, before any tenant needs it
        self.max_tokens, self.max_tenants = max_tokens, max_tenants
        self._by_tenant: OrderedDict[str, SharedSuffixes] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, tenant: str | None) -> SharedSuffixes | None:
        """The tenant's structure (made on its first request; the most recently used); None: no tenant, nothing
        shared."""
        if tenant is None:
            return None
        with self._lock:
            shared = self._by_tenant.get(tenant)
            if shared is None:
                shared = self._by_tenant[tenant] = SharedSuffixes(self.max_tokens)
                while len(self._by_tenant) > self.max_tenants:
                    self._by_tenant.popitem(last=False)
            self._by_tenant.move_to_end(tenant)
            return shared

    @property
    def tenants(self) -> int:
        return len(self._by_tenant)

    @property
    def size(self) -> int:
        """States held by every tenant's structure (the memory measure)."""
        with self._lock:
            return sum(s.size for s in self._by_tenant.values())
