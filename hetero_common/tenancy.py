"""Request ids by tenant: with API keys on, every request id lives in its key's namespace.

The gateway names each key by a label (`key_label`: `key-` and 12 hex digits of the key's
SHA-256, never the key) and sends the scheduler `<label>/<client id>`, so that two keys using
the same id are two requests: one key cannot abort, re-attach to or learn of another's. With no
keys there is one tenant, "", and ids go through unchanged. The scheduler treats ids as opaque,
except for an admin's abort across tenants (`AbortRequest.any_tenant`), which matches
`client_id` below.
"""

from __future__ import annotations

import hashlib

LABEL_PREFIX = "key-"
LABEL_HEX_DIGITS = 12
_LABEL_LEN = len(LABEL_PREFIX) + LABEL_HEX_DIGITS


def key_label(key: str) -> str:
    """How logs, metrics and request ids name a key's tenant: a digest prefix, never the key itself
    (48 bits of a hash of a secret key say nothing usable about it)."""
    return LABEL_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:LABEL_HEX_DIGITS]


def scoped_id(tenant: str, request_id: str) -> str:
    """The id the scheduler knows a tenant's request by."""
    return f"{tenant}/{request_id}" if tenant else request_id


def client_id(scoped: str) -> str:
    """The id the client sent (the inverse of `scoped_id` for a keyed tenant)."""
    if len(scoped) > _LABEL_LEN and scoped[_LABEL_LEN] == "/" and scoped.startswith(LABEL_PREFIX):
        return scoped[_LABEL_LEN + 1:]
    return scoped
