"""Typed storage failures that callers above storage/ may see."""


class StorageError(Exception):
    """Base of every error storage/ raises on purpose."""


class DatabaseUnavailable(StorageError):
    """The connection or the server is gone; the unit of work did not complete.
    The pool reconnects on its own, so a later unit of work may succeed."""


class LeaseLost(DatabaseUnavailable):
    """This node no longer owns the scope (its lease was taken over or ran out):
    the transaction committed nothing, so the command may run at the owner."""


class SchemaDrift(StorageError):
    """The live database does not match the schema definition."""


class NotFound(StorageError):
    """Missing, or in another workspace: callers must not be able to tell which."""


class Conflict(StorageError):
    """The write contradicts current state (already used, last owner, duplicate...)."""

    def __init__(self, reason: str, message: str | None = None) -> None:
        super().__init__(message or reason)
        self.reason = reason


class WriteFenced(StorageError):
    """The caller's execution generation is stale or the workspace is write-fenced;
    nothing was committed (workspace-multi-tenant.md §10.3)."""


class Forbidden(StorageError):
    """Exists in the caller's workspace, but the state forbids it (e.g. suspended)."""
