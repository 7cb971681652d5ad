"""A request served from a connection's cached context carries the proof that
context was built from; the write's own transaction compares it with the rows
as they are now (storage/tenancy: proof_rows_query, read by the batch's fence
statement, or stale_proofs), so a revocation that committed
before the write refuses it even when this server has not yet heard of it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CredentialProof:
    kind: str  # "api_key" | "account"
    credential_id: str  # the API key's id, or the session's account id
    workspace_id: str
    # The credential, membership, member, workspace and execution columns the
    # context was derived from: any change to them makes the proof stale.
    fingerprint: tuple
    expires_at: float | None = None  # an API key's expiry (epoch seconds), checked on each use


class StaleCredential(Exception):
    """The proof no longer matches: nothing was written; serve the request afresh."""
