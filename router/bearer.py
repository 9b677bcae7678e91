"""Bearer keys: the HTTP API's (`http.api_keys`, the `Authorization` header) and Admin's (`router.admin_keys`, the
`authorization` metadata of a gRPC call). A key is compared in constant time, so that how long a refusal takes says
nothing of how much of a guess was right.

    allowed(["k1", "k2"], "Bearer k2")   # True
"""
from __future__ import annotations

import hmac

ADMIN_KEY_ENV = "SPECPOOL_ADMIN_KEY"      # the key `specpool reload` / `status` send, before --config's first
ADMIN_REFUSED = ("missing or wrong admin key: router.admin_keys is set, so Admin calls must carry the metadata "
                 f"'authorization: Bearer <key>' (specpool reload / status send ${ADMIN_KEY_ENV}, else the first "
                 "of --config's router.admin_keys)")


def allowed(keys: list[str], authorization: str | None) -> bool:
    """Whether an `authorization` value ("Bearer <key>") names one of `keys`; with no keys, anyone is allowed."""
    if not keys:
        return True
    given = (authorization or "").encode()
    return any(hmac.compare_digest(given, f"Bearer {key}".encode()) for key in keys)


def metadata_authorization(metadata) -> str | None:
    """A gRPC call's `authorization` metadata value (invocation_metadata(): (key, value) pairs), or None."""
    return next((value for key, value in metadata or () if key == "authorization"), None)
