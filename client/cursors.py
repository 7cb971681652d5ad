"""Resume cursors shared by the trio and asyncio resuming clients."""

from __future__ import annotations

from typing import Any


class Cursors:
    """Per followed scope the last delivered seq, and the workspace feed's last
    global seq.  `accept` advances them and refuses anything already delivered."""

    def __init__(self) -> None:
        self.scopes: dict[str, int | None] = {}
        self.workspace_feed = False
        self.global_seq: int | None = None

    def subscribe_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"scopes": [{"scope_id": s, "after_seq": c} for s, c in self.scopes.items()]}
        if self.workspace_feed:
            fields["workspace_feed"] = True
            fields["after_global_seq"] = self.global_seq
        return fields

    def started(self, subscribe_result: dict) -> None:
        """Live-from-now subscriptions learn their starting cursor from the reply."""
        for scope in subscribe_result["scopes"]:
            if self.scopes.get(scope["id"]) is None:
                self.scopes[scope["id"]] = scope["latest_seq"]
        if self.workspace_feed and self.global_seq is None:
            self.global_seq = subscribe_result.get("workspace_global_seq", 0)

    def accept(self, event: dict) -> bool:
        seq, scope_id = event.get("seq"), event.get("scope_id")
        if seq is None or event.get("event") != "message.created":
            return True
        if scope_id in self.scopes:
            cursor = self.scopes[scope_id]
            if cursor is not None and seq <= cursor:
                return False
            self.scopes[scope_id] = seq
            return True
        if self.workspace_feed:
            global_seq = event.get("global_seq")
            if self.global_seq is not None and global_seq is not None and global_seq <= self.global_seq:
                return False
            self.global_seq = global_seq
        return True
