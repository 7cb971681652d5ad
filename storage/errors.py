"""Typed storage failures that callers above storage/ may see."""


class StorageError(Exception):
    """Base of every error storage/ raises on purpose."""


class DatabaseUnavailable(StorageError):
    """The connection or the server is gone; the unit of work did not complete.
    The pool reconnects on its own, so a later unit of work may succeed."""


class SchemaDrift(StorageError):
    """The live database does not match the schema definition."""
