"""Strand rules (strand-message.md §3-§8), pure: shared by the strand commands the
scope actor runs and by the storage that keeps their results.  Nothing here does
I/O.  A rule that refuses raises StrandRuleError with the protocol code and the
seed's reason (`schema_violation`, `track_disabled`, `primary_track_required`,
`failed_precondition`, `watch_must_be_self`, ...)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# track-name-registry.json's active rows (§4): exactly these two are admitted.
TRACK_NAMES = ("discussion", "synthesis")
TRACK_NAME_SYNTAX = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
TRACK_FIELDS = ("enabled", "is_primary", "profile", "template", "metadata")
STAGES = ("draft", "proposed", "planned", "in_progress", "blocked", "done", "cancelled", "superseded")
WATCH_LEVELS = ("mentions_only", "participating", "all", "muted")
# A watch written by someone else for you may never silence you or publish you (§8.4).
OTHERS_LEVELS = ("mentions_only", "participating", "all")
AUDIENCES = ("effective_scope_members", "strand_participants", "strand_watchers", "strand_engaged",
             "assigned_actors")
# The UI tokens and the audience each maps to (§9.4.3: @here is strand_engaged, not presence).
AUDIENCE_TOKENS = {"all": "effective_scope_members", "here": "strand_engaged", "participants": "strand_participants",
                   "watchers": "strand_watchers", "assignees": "assigned_actors"}
# metadata.fields names that would be a second source of truth (§3.2, §7.1, §8.1).
RESERVED_FIELDS = frozenset({"status", "stage", "stage_reason", "lifecycle", "progress_state", "assignee",
                             "assignees", "assigned_to", "assigned_actor_ids", "board_space_id", "list_space_id",
                             "rank", "participants", "watchers"})


class StrandRuleError(Exception):
    def __init__(self, code: str, reason: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.field = code, reason, message, field


def schema_violation(message: str, field: str | None = None) -> StrandRuleError:
    return StrandRuleError("invalid", "schema_violation", message, field)


def precondition(reason: str, message: str) -> StrandRuleError:
    return StrandRuleError("conflict", reason, message)


# --- tracks (§4) ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Track:
    enabled: bool = True
    is_primary: bool = False
    profile: str | None = None
    template: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"enabled": self.enabled, "is_primary": self.is_primary}
        for name in ("profile", "template"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.metadata:
            out["metadata"] = self.metadata
        return out


Tracks = dict[str, Track]


def _check_track_name(name: str) -> None:
    if name not in TRACK_NAMES:
        # The syntax alone admits nothing: only registered names (§4).
        raise schema_violation(f"unregistered track name {name!r}", f"tracks.{name}")


def _field_value(name: str, key: str, value: Any) -> Any:
    where = f"tracks.{name}.{key}"
    if key in ("enabled", "is_primary"):
        if not isinstance(value, bool):
            raise schema_violation(f"{where} must be a boolean", where)
        return value
    if key in ("profile", "template"):
        if not isinstance(value, str) or not 1 <= len(value) <= 64:
            raise schema_violation(f"{where} must be a string of 1-64 characters", where)
        return value
    if not isinstance(value, dict):
        raise schema_violation(f"{where} must be an object", where)
    return value


def tracks_from_json(raw: Any) -> Tracks:
    """Tracks as stored, or as given to strand.create: a non-empty map of registered
    names to entries; `content` never sits in an entry (synthesis content has its own
    write path, discussion carries none)."""
    if not isinstance(raw, dict) or not raw:
        raise schema_violation("tracks must be a non-empty object", "tracks")
    tracks: Tracks = {}
    for name, entry in raw.items():
        _check_track_name(name)
        if not isinstance(entry, dict):
            raise schema_violation(f"tracks.{name} must be an object", f"tracks.{name}")
        values: dict[str, Any] = {}
        for key, value in entry.items():
            if key not in TRACK_FIELDS:
                raise schema_violation(f"tracks.{name}.{key} is not a track field", f"tracks.{name}.{key}")
            values[key] = _field_value(name, key, value)
        tracks[name] = Track(**values)
    check_tracks(tracks)
    return tracks


def tracks_json(tracks: Tracks) -> dict[str, Any]:
    return {name: tracks[name].as_json() for name in sorted(tracks)}


def check_tracks(tracks: Tracks) -> None:
    """The post-state rules: at most one explicit primary, never on a disabled track,
    and a primary that resolves (§4.5, §6)."""
    explicit = [name for name, track in tracks.items() if track.is_primary]
    if len(explicit) > 1:
        raise schema_violation("at most one track may be primary", "tracks")
    if explicit and not tracks[explicit[0]].enabled:
        raise precondition("track_disabled", f"the primary track {explicit[0]!r} is disabled")
    resolve_primary(tracks)


def resolve_primary(tracks: Tracks) -> str:
    """§4.5: the explicit primary; else synthesis; else the only enabled track; else fail closed."""
    enabled = {name: track for name, track in tracks.items() if track.enabled}
    explicit = [name for name, track in enabled.items() if track.is_primary]
    if len(explicit) == 1:
        return explicit[0]
    if "synthesis" in enabled:
        return "synthesis"
    if len(enabled) == 1:
        return next(iter(enabled))
    raise precondition("primary_track_required", "no primary track resolves: set tracks.<name>.is_primary")


def is_active(tracks: Tracks, name: str) -> bool:
    track = tracks.get(name)
    return track is not None and track.enabled


def apply_tracks_patch(tracks: Tracks, patch: Any) -> Tracks:
    """ak.strand.tracks.update (§4.6-§4.8): `patch` maps `tracks.<name>.<field>` to
    {"$op": "set", "value": ...} or {"$op": "unset"}; applied atomically or not at all."""
    if not isinstance(patch, dict) or not patch:
        raise schema_violation("patch must be a non-empty object", "patch")
    changes: dict[str, dict[str, Any]] = {}
    for path, op in patch.items():
        parts = path.split(".") if isinstance(path, str) else []
        if len(parts) != 3 or parts[0] != "tracks":
            # Whole entries or the whole map would bypass the per-field rules (§4.8).
            raise schema_violation(f"{path!r}: patch paths are tracks.<name>.<field>", "patch")
        _, name, key = parts
        _check_track_name(name)
        if key in ("content", "encrypted_content"):
            raise schema_violation(f"{path}: track content is written by strand.update", "patch")
        if key not in TRACK_FIELDS:
            raise schema_violation(f"{path}: not a track field", "patch")
        if not isinstance(op, dict) or op.get("$op") not in ("set", "unset") or (
                op["$op"] == "set" and set(op) != {"$op", "value"}) or (op["$op"] == "unset" and set(op) != {"$op"}):
            raise schema_violation(f"{path}: give {{\"$op\": \"set\", \"value\": ...}} or {{\"$op\": \"unset\"}}",
                                   "patch")
        if op["$op"] == "unset" and key == "enabled":
            raise schema_violation(f"{path}: a track is closed with enabled: set false, never removed", "patch")
        changes.setdefault(name, {})[key] = (_field_value(name, key, op["value"]) if op["$op"] == "set"
                                             else _UNSET)
    before_primary = _resolve_or_none(tracks)
    after: Tracks = dict(tracks)
    for name, fields in changes.items():
        current = tracks.get(name)
        if current is None:
            # A track comes into being only by an explicit enabled: true (never implicitly, §4.3, §4.6).
            if fields.get("enabled") is not True:
                raise precondition("track_disabled", f"track {name!r} does not exist: set "
                                                     f"tracks.{name}.enabled to true in the same patch")
            current = Track()
        values = {"enabled": current.enabled, "is_primary": current.is_primary, "profile": current.profile,
                  "template": current.template, "metadata": current.metadata}
        for key, value in fields.items():
            if value is _UNSET:
                values[key] = False if key == "is_primary" else ({} if key == "metadata" else None)
            else:
                values[key] = value
        after[name] = Track(**values)
    explicit = [name for name, track in after.items() if track.is_primary]
    if len(explicit) > 1:
        raise schema_violation("at most one track may be primary", "patch")
    if explicit and not after[explicit[0]].enabled:
        raise precondition("track_disabled", f"the primary track {explicit[0]!r} is disabled")
    if before_primary is not None and not after[before_primary].enabled:
        # Closing the current primary hands it over in the same patch (§4.7).
        if not explicit or explicit[0] == before_primary:
            raise precondition("primary_track_required",
                               f"closing the primary track {before_primary!r} needs another active track "
                               f"set primary in the same patch")
    if not any(track.enabled for track in after.values()):
        raise precondition("primary_track_required", "at least one track stays enabled")
    resolve_primary(after)
    return after


_UNSET = object()


def _resolve_or_none(tracks: Tracks) -> str | None:
    try:
        return resolve_primary(tracks)
    except StrandRuleError:
        return None


def check_fields(fields: Any) -> dict[str, Any]:
    """metadata.fields: an object without reserved names (§3.2, §7.1, §8.1)."""
    if not isinstance(fields, dict):
        raise schema_violation("fields must be an object", "fields")
    for key in fields:
        if not isinstance(key, str) or key.lower() in RESERVED_FIELDS:
            raise schema_violation(f"fields.{key} is reserved: it has its own write path", f"fields.{key}")
    return fields


# --- stage (§3.2) -------------------------------------------------------------------------------

def check_stage_set(current: str | None, stage: str, expected_given: bool, expected: str | None) -> None:
    """Compare-and-set: from the initial (never set) state expected_stage may be
    omitted or null; after that it must name the current stage."""
    if stage not in STAGES:
        raise schema_violation(f"unknown stage {stage!r}", "stage")
    if expected_given and expected is not None and expected not in STAGES:
        raise schema_violation(f"unknown expected_stage {expected!r}", "expected_stage")
    if current is None:
        if expected_given and expected is not None:
            raise precondition("failed_precondition", "the strand has no stage yet: omit expected_stage")
        return
    if not expected_given or expected != current:
        raise precondition("failed_precondition", "expected_stage does not match the current stage")


# --- watch (§8) ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class WatchValue:
    """The typed current result's value; level None is an explicit clear (mentions_only)."""

    level: str | None
    level_public: bool | None = None

    def as_json(self) -> dict[str, Any] | None:
        if self.level is None:
            return None
        out: dict[str, Any] = {"level": self.level}
        if self.level_public is not None:
            out["level_public"] = self.level_public
        return out


def watch_value(level: Any, level_public: Any) -> WatchValue:
    if level is not None and level not in WATCH_LEVELS:
        raise schema_violation(f"unknown watch level {level!r}", "level")
    if level is None and level_public is not None:
        raise schema_violation("level_public only with a level", "level_public")
    if level_public is not None and not isinstance(level_public, bool):
        raise schema_violation("level_public must be a boolean", "level_public")
    return WatchValue(level, level_public)


def expected_watch(raw: Any) -> WatchValue:
    """expected_value as given: null, or {level, level_public?}."""
    if raw is None:
        return WatchValue(None)
    if not isinstance(raw, dict) or "level" not in raw or set(raw) - {"level", "level_public"}:
        raise schema_violation("expected_value is null or {level, level_public?}", "expected_value")
    return watch_value(raw["level"], raw.get("level_public"))


def check_watch_write(writer: str, watcher: str, value: WatchValue, written: WatchValue | None,
                      expected_given: bool, expected: WatchValue | None, may_write_others: bool) -> None:
    """§8.3-§8.4: self only unless .others; .others never mutes nor publishes; whole-value
    CAS: an omitted expected_value passes only when nothing was ever written, and a given
    one must equal the whole current value (a cleared value is `null`)."""
    if writer != watcher:
        if not may_write_others:
            raise precondition("watch_must_be_self", "you may set only your own watch")
        if value.level == "muted":
            raise precondition("failed_precondition", "only the watcher may mute their watch")
        if value.level_public:
            raise precondition("failed_precondition", "only the watcher may publish their watch")
    if written is None:
        if expected_given and expected is not None:
            raise precondition("failed_precondition", "nothing was written yet: omit expected_value")
        return
    if not expected_given:
        raise precondition("failed_precondition", "the watch exists: give expected_value (the whole current value)")
    if _normalized(expected) != _normalized(written):
        raise precondition("failed_precondition", "expected_value does not match the current watch")


def _normalized(value: WatchValue | None) -> tuple:
    if value is None or value.level is None:
        return (None, None)
    return (value.level, value.level_public)


def effective_level(explicit: str | None, implicit_participating: bool) -> str:
    """§8.7: an explicit level wins (muted above all); otherwise assignment or an own
    active message make it participating; otherwise mentions_only."""
    if explicit is not None:
        if explicit == "mentions_only" and implicit_participating:
            return "participating"
        return explicit
    return "participating" if implicit_participating else "mentions_only"


# --- the projection (protocol StrandInfo's shape) ------------------------------------------------------

def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _ms(value: Any) -> int | None:
    return None if value is None else int(value.timestamp() * 1000)


def strand_view(row: Any, assignments: list[Any], my_watch: Any = None) -> dict[str, Any]:
    """A strand as readers see it: primary resolved (§4.5), is_default derived (§2.1),
    assignments from the active relations (§7.1), `my_watch` only for its watcher."""
    tracks = tracks_from_json(_json(row["tracks"]))
    fields = _json(row["fields"])
    track_views: dict[str, Any] = {}
    for name, track in tracks.items():
        view = track.as_json()
        if name == "synthesis":
            view["content"] = row["synthesis_content"] or ""
            view["revision"] = row["synthesis_revision"]
        track_views[name] = view
    out: dict[str, Any] = {
        "id": row["scope_id"], "board_id": row["board_id"], "channel_id": row["channel_id"], "title": row["title"],
        "content": row["content"], "fields": fields, "tracks": track_views,
        "primary_track": resolve_primary(tracks), "state": row["state"], "version": row["version"],
        "latest_seq": row["latest_seq"], "is_default": bool(row["is_default"]),
        "created_by_member_id": row["created_by_member_id"], "created_at_ms": _ms(row["created_at"]),
        "updated_at_ms": _ms(row["updated_at"]),
        "assigned_member_ids": [a["member_id"] for a in assignments],
        "assignments": [{"assignment_id": a["id"], "member_id": a["member_id"]} for a in assignments],
    }
    for key, value in (("summary", row["summary"]), ("stage", row["stage"]),
                       ("stage_changed_at_ms", _ms(row["stage_changed_at"])),
                       ("state_changed_at_ms", _ms(row["state_changed_at"])),
                       ("updated_by_member_id", row["updated_by_member_id"]),
                       ("accept_third_party_mention", row["accept_third_party_mention"])):
        if value is not None:
            out[key] = value
    if my_watch is not None and my_watch["level"] is not None:
        out["my_watch"] = WatchValue(my_watch["level"], my_watch["level_public"]).as_json()
    return out


def projected(level: str | None, level_public: bool | None, watcher_kind: str, is_self: bool) -> bool:
    """§8.5-§8.6: does a watch appear in the watcher list this viewer sees?  mentions_only
    (or a cleared value) is "not subscribed" for everyone; muted only for yourself; another
    human's level only when they published it; an agent's level always (never muted)."""
    if level is None or level == "mentions_only":
        return False
    if is_self:
        return True
    if level == "muted":
        return False
    return watcher_kind == "agent" or bool(level_public)
