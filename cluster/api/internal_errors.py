"""What a client is told about a failure that is not its fault: an incident id, never the exception text.

Exception text can carry paths, tensor shapes, other requests' ids or a peer's address; it goes to the
server log under the incident id, and the client gets the id to quote.
"""
from __future__ import annotations

import logging
import uuid


def report_internal_error(logger: logging.Logger, error: BaseException, request_id: str | None) -> str:
    """Logs `error` with its traceback under a fresh incident id; returns the message for the client."""
    incident = uuid.uuid4().hex[:12]
    logger.error("request %s failed (incident %s)", request_id or "-", incident, exc_info=error)
    return f"internal error (incident {incident}); the server log has the details"
