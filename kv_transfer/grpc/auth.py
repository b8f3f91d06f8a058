"""The cluster secret on the KVTransfer.Push stream: the sender's call metadata and the receiver's check.

A per-cluster secret (TransferConfig.cluster_secret, generated where the workers are launched) closes
the gRPC KV plane to peers of other clusters: the sender sends it as call metadata on every stream,
the receiver compares it in constant time before it reads a chunk. The secret is never logged.
"""
from __future__ import annotations

import hmac
from typing import Iterable

SECRET_METADATA_KEY = "tandem-kv-secret"
REFUSAL = "this KV receiver accepts only peers of its own cluster: missing or wrong cluster secret"


def secret_metadata(secret: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata a sender attaches to each Push (None: no secret, nothing attached)."""
    return None if secret is None else ((SECRET_METADATA_KEY, secret),)


def is_authorized(expected: str | None, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Whether a call's metadata satisfies a receiver holding `expected`: always when it holds none; else
    exactly one value under SECRET_METADATA_KEY, equal to it (compared in constant time). Changes nothing."""
    if expected is None:
        return True
    given = [value for key, value in (metadata or ()) if key == SECRET_METADATA_KEY]
    if len(given) != 1:
        return False
    value = given[0]
    presented = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(presented, expected.encode("ascii"))
