"""ApiKeyCheck: the optional shared-secret check of both front ends (constant-time comparison)."""
from __future__ import annotations

import hmac
from dataclasses import dataclass


@dataclass(frozen=True)
class ApiKeyCheck:
    """api_key None accepts everything; otherwise a request must carry the key as
    `Authorization: Bearer KEY` or `x-api-key: KEY`."""

    api_key: str | None

    def accepts(self, authorization: str | None, x_api_key: str | None = None) -> bool:
        """True if the request's header values carry the key (or no key is configured)."""
        if self.api_key is None:
            return True
        offered = []
        if authorization:
            scheme, _, token = authorization.strip().partition(" ")
            if scheme.lower() == "bearer":
                offered.append(token.strip())
        if x_api_key:
            offered.append(x_api_key.strip())
        expected = self.api_key.encode()
        return any(hmac.compare_digest(token.encode(), expected) for token in offered)
