"""Stable error codes: the one place they are defined.

A code never changes meaning once published; clients switch on it.  The
message that travels with it is for humans and may change.
"""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    BAD_FRAME = "bad_frame"                      # not decodable, wrong types, missing fields
    UNKNOWN_OP = "unknown_op"                    # well-formed frame naming an op the server lacks
    UNAUTHENTICATED = "unauthenticated"          # no valid credential on this connection
    NOT_FOUND = "not_found"                      # missing, or in another workspace (never "forbidden")
    FORBIDDEN = "forbidden"                      # exists in your workspace, but not permitted
    WORKSPACE_REQUIRED = "workspace_required"    # the command needs a workspace and none was given
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"  # same client key, different payload
    CONFLICT = "conflict"                        # state changed underneath (expected revision, uniqueness)
    INVALID = "invalid"                          # well-typed but semantically invalid argument
    CONTENT_BLOCKED = "content_blocked"          # the deployment's moderation keywords refuse the content
    EDITION_LIMIT = "edition_limit"              # the edition policy forbids it (a second workspace)
    FENCED = "fenced"                            # stale execution generation or write-fenced workspace
    RATE_LIMITED = "rate_limited"
    TOO_LARGE = "too_large"
    SLOW_CONSUMER = "slow_consumer"
    UNAVAILABLE = "unavailable"                  # dependency (database) down; retry later
    INTERNAL = "internal"                        # a bug; logged with the request id


class ProtocolError(Exception):
    """Raised anywhere below the connection handler; becomes one error frame."""

    def __init__(self, code: ErrorCode, message: str, *, details: dict | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details or {}
