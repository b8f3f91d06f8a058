"""The cluster secret and the session flag on the KVTransfer.Push stream: sender metadata, receiver check.

A per-cluster secret (TransferConfig.cluster_secret, generated where the workers are launched) closes
the gRPC KV plane to peers of other clusters: the sender sends it as call metadata on every stream,
the receiver compares it in constant time before it reads a chunk. The secret is never logged.
"""
from __future__ import annotations

import hmac
from typing import Iterable

SECRET_METADATA_KEY = "tandem-kv-secret"
# A sender that keeps its Push stream for many transfers (a session) says so in its call metadata; the
# receiver confirms in its initial metadata. A call without it carries exactly one transfer, as before.
SESSION_METADATA = ("tandem-kv-session", "1")
# A session's trailing metadata: how many transfers it began (read a manifest of), so a sender whose next
# transfer found the stream ended knows whether the receiver saw that transfer at all.
TRANSFERS_METADATA_KEY = "tandem-kv-transfers"
REFUSAL = "this KV receiver accepts only peers of its own cluster: missing or wrong cluster secret"


def secret_metadata(secret: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata a sender attaches to each Push (None: no secret, nothing attached)."""
    return None if secret is None else ((SECRET_METADATA_KEY, secret),)


def session_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata of a session stream: the session flag, and the secret when there is one."""
    return (SESSION_METADATA,) + (secret_metadata(secret) or ())


def asks_for_session(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Whether a call's metadata (the sender's, or the receiver's initial metadata) carries the session flag."""
    key, flag = SESSION_METADATA
    return any(k == key and (v == flag or v == flag.encode()) for k, v in (metadata or ()))


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
