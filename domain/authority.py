"""Private authority as a scope actor holds it in memory (SPEC §5 decision 9:
the send path authorizes from the actor's cache, with no per-message query).

The rules are storage/visibility/predicate.py's, restated for the one case the
actor meets: a message it has just committed (so inside every open interval)
and a mention or explicit recipient it is about to authorize.  Both read the
same windows (scope_private_grants and People collaborators on the scope's
chain), loaded for the owners of the private members of the scope and, for a
thread, of its parent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from domain.plan import RosterEntry


@dataclass(frozen=True)
class AuthorityWindow:
    """One grant or People collaborator row: `author_member_id` may contribute
    to `owner_member_id`'s private agents from `scope_id` (this scope or the
    thread's parent) inside this window."""

    kind: str  # grant | collaborator
    ref_id: str
    owner_member_id: str
    author_member_id: str
    scope_id: str
    from_global_seq: int
    to_global_seq: int | None
    expires_at: datetime | None
    # Ended by its expiry: to_global_seq is then only a pruning bound and the exact
    # test is created_at < expires_at (storage/visibility/predicate.py CLOSED_BY_EXPIRY).
    closed_by_expiry: bool = False

    def covers(self, global_seq: int, created_at: datetime) -> bool:
        """Was a message with this global seq and commit time written inside the window?"""
        return (self.from_global_seq <= global_seq
                and (self.to_global_seq is None or global_seq <= self.to_global_seq or self.closed_by_expiry)
                and (self.expires_at is None or created_at < self.expires_at))

    def active_at(self, now: datetime) -> bool:
        """Does the window still grant authority (not ended, not expired)?"""
        return self.to_global_seq is None and (self.expires_at is None or now < self.expires_at)


@dataclass
class ScopeAuthority:
    """The windows that matter to one scope, by (owner, author)."""

    windows: dict[tuple[str, str], list[AuthorityWindow]] = field(default_factory=dict)

    @classmethod
    def of(cls, windows: Iterable[AuthorityWindow]) -> ScopeAuthority:
        authority = cls()
        for window in windows:
            authority.windows.setdefault((window.owner_member_id, window.author_member_id), []).append(window)
        return authority

    def covering(self, owner: str, author: str, global_seq: int, created_at: datetime) -> AuthorityWindow | None:
        for window in self.windows.get((owner, author), ()):
            if window.covers(global_seq, created_at):
                return window
        return None

    def active(self, owner: str, author: str, now: datetime) -> AuthorityWindow | None:
        # Grants before collaborators: the order the readable predicate reports them in.
        for window in sorted(self.windows.get((owner, author), ()), key=lambda w: w.kind != "grant"):
            if window.active_at(now):
                return window
        return None


def private_read_reason(reader: RosterEntry, author: str, author_entry: RosterEntry | None,
                        authority: ScopeAuthority, seq: int, global_seq: int, created_at: datetime) -> str | None:
    """Why the private member `reader` (its open membership) may read a message of
    its scope that `author` wrote (None: it may not).  `author_entry` is the
    author's open membership.  Only open intervals are known here: a message
    inside an earlier, closed interval answers None (the SQL predicate, which
    knows them all, decides replays)."""
    owner = reader.owner_member_id
    if seq < reader.effective_from_seq or owner is None:
        return None
    if author == reader.member_id:
        return "own_output"
    if author == owner:
        return "owner"
    if (author_entry is not None and author_entry.visibility == "private" and author_entry.owner_member_id == owner
            and author_entry.effective_from_seq <= seq):
        return "same_owner_agent"
    window = authority.covering(owner, author, global_seq, created_at)
    return window.kind if window is not None else None


def wake_authority(author: str, author_entry: RosterEntry | None, owner: str, authority: ScopeAuthority,
                   now: datetime) -> tuple[str, str | None] | None:
    """May `author` address a private agent of `owner` here (collaborator-policy §5)?
    (reason, grant or collaborator id), or None: the mention stays plain text."""
    if author == owner:
        return "owner", None
    if author_entry is not None and author_entry.visibility == "private" and author_entry.owner_member_id == owner:
        return "same_owner_agent", None
    window = authority.active(owner, author, now)
    return (window.kind, window.ref_id) if window is not None else None
