"""Property tests of a strand's tracks, stage and watches (issue 16;
strand-message.md §3.2, §4.5-§4.8, §8.3-§8.5) against a plain-Python model
written from the seed's prose.  The model imports nothing from domain/,
storage/ or actors/; where the seed leaves the exact refusal reason open (two
rules broken at once, or a class the seed does not name) it answers the SET
of acceptable (code, reason) pairs, and the server must answer one of them.

1. A Hypothesis state machine drives the live server over the WebSocket (one
   server in a thread, one strand per example; owner O1, admin O2, operator
   H): `strand.tracks.update`, `strand.stage.set` and `strand.watch.set` with
   random patches, expectations and writers.  After every step the server's
   accept/refuse decision must be the model's, and `strand.get` (tracks,
   primary, stage, version, `my_watch`), `strand.watch.get` and
   `strand.watchers` as each member must show the model's state.
2. The same model against domain/strands.py's pure rules on many more inputs
   (no server): a disagreement there names the rule before the server does."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from client import ClientError, connect
from domain import strands as domain
from tests.conftest import MEMBER_PASSWORD
from tests.server_thread import ServerThread
from tests.test_private_visibility_model import people_server

# --- the model ---------------------------------------------------------------------------------------------

REGISTERED = ("discussion", "synthesis")  # §4: the active track-name registry, exactly these
TRACK_FIELDS = ("enabled", "is_primary", "profile", "template", "metadata")  # §4.1 (content has its own path)
STAGES = ("draft", "proposed", "planned", "in_progress", "blocked", "done", "cancelled", "superseded")
GOVERNORS = ("O1", "O2")  # owner and admin: may write another member's watch (§8.4 `.others`)
MEMBERS = ("O1", "O2", "H")

SCHEMA = ("invalid", "schema_violation")
TRACK_DISABLED = ("conflict", "track_disabled")
PRIMARY_REQUIRED = ("conflict", "primary_track_required")
PRECONDITION = ("conflict", "failed_precondition")
NOT_SELF = ("conflict", "watch_must_be_self")


class Refusal(Exception):
    """The model refuses: the server may answer any one of `allowed` (code, reason)."""

    def __init__(self, allowed: set[tuple[str, str]]) -> None:
        super().__init__(allowed)
        self.allowed = allowed


def entry(enabled: bool = True, is_primary: bool = False, profile: str | None = None, template: str | None = None,
          metadata: dict | None = None) -> dict[str, Any]:
    return {"enabled": enabled, "is_primary": is_primary, "profile": profile, "template": template,
            "metadata": metadata or {}}


def resolve(tracks: dict[str, dict]) -> str | None:
    """§4.5 over the enabled tracks only: the one explicit primary; else synthesis; else the only
    track; else nothing (the strand must then be told explicitly)."""
    enabled = [name for name, track in tracks.items() if track["enabled"]]
    explicit = [name for name in enabled if tracks[name]["is_primary"]]
    if len(explicit) == 1:
        return explicit[0]
    if "synthesis" in enabled:
        return "synthesis"
    if len(enabled) == 1:
        return enabled[0]
    return None


def valid_value(key: str, value: Any) -> bool:
    if key in ("enabled", "is_primary"):
        return isinstance(value, bool)
    if key in ("profile", "template"):
        return isinstance(value, str) and 1 <= len(value) <= 64
    return isinstance(value, dict)


def post_state_violations(before: dict[str, dict] | None, after: dict[str, dict]) -> set[tuple[str, str]]:
    """The rules a tracks map breaks (§4.5, §4.7), `before` the map it replaces (None: a new strand)."""
    broken: set[tuple[str, str]] = set()
    explicit = [name for name, track in after.items() if track["is_primary"]]
    if len(explicit) > 1:
        broken |= {SCHEMA, PRECONDITION}  # "at most one": the seed names no class
    if any(not after[name]["enabled"] for name in explicit):
        broken.add(TRACK_DISABLED)  # §4.5: an explicit primary on a disabled track
    if before is not None:
        old = resolve(before)
        handed_over = any(name != old and after[name]["enabled"] for name in explicit)
        if old is not None and not after[old]["enabled"] and not handed_over:
            broken.add(PRIMARY_REQUIRED)  # §4.7: closing the primary hands it over in the same patch
    if not any(track["enabled"] for track in after.values()) or (len(explicit) <= 1 and resolve(after) is None):
        broken.add(PRIMARY_REQUIRED)
    return broken


def patch_tracks(tracks: dict[str, dict], patch: dict[str, Any]) -> dict[str, dict]:
    """§4.6-§4.8: `tracks.<registered name>.<field>` paths only, `$op` set/unset; a missing track
    comes into being only by `enabled: set true` in the same patch; all or nothing."""
    if not patch:
        raise Refusal({SCHEMA})
    changes: dict[str, dict[str, Any]] = {}
    for path, op in patch.items():
        parts = path.split(".")
        if len(parts) != 3 or parts[0] != "tracks" or parts[1] not in REGISTERED or parts[2] not in TRACK_FIELDS:
            raise Refusal({SCHEMA})  # unregistered names, content, whole entries
        _, name, key = parts
        if not isinstance(op, dict) or op.get("$op") not in ("set", "unset"):
            raise Refusal({SCHEMA})
        if op["$op"] == "set" and (set(op) != {"$op", "value"} or not valid_value(key, op["value"])):
            raise Refusal({SCHEMA})
        if op["$op"] == "unset" and set(op) != {"$op"}:
            raise Refusal({SCHEMA})
        changes.setdefault(name, {})[key] = op
    broken: set[tuple[str, str]] = set()
    after = {name: dict(track) for name, track in tracks.items()}
    for name, ops in changes.items():
        if name not in after:
            if ops.get("enabled") != {"$op": "set", "value": True}:
                broken |= {TRACK_DISABLED, PRECONDITION}  # §4.6: never created implicitly
            after[name] = entry()
        for key, op in ops.items():
            default = entry()[key]
            after[name][key] = op["value"] if op["$op"] == "set" else default
    broken |= post_state_violations(tracks, after)
    if broken:
        raise Refusal(broken)
    return after


def check_stage(current: str | None, expected: Any) -> None:
    """§3.2: from the initial state `expected_stage` may be omitted (or null); after that it must
    be the current stage.  `expected` is OMIT when not sent."""
    if current is None:
        if expected is not OMIT and expected is not None:
            raise Refusal({PRECONDITION})
    elif expected is OMIT or expected != current:
        raise Refusal({PRECONDITION})


OMIT = object()
NEVER = object()  # a watch never written


def watch_value(level: str | None, level_public: bool | None) -> dict | None:
    if level is None:
        return None
    return {"level": level} if level_public is None else {"level": level, "level_public": level_public}


def check_watch(writer: str, watcher: str, level: str | None, level_public: bool | None, current: Any,
                expected: Any) -> None:
    """§8.3-§8.4.  `current` is NEVER or the whole current value (None once cleared)."""
    broken: set[tuple[str, str]] = set()
    if level is None and level_public is not None:
        broken.add(SCHEMA)  # level null: level_public MUST be omitted
    if writer != watcher:
        if writer not in GOVERNORS:
            broken.add(NOT_SELF)
        elif level == "muted" or level_public is True:
            broken.add(PRECONDITION)  # .others never mutes nor publishes
    if current is NEVER:
        if expected is not OMIT:
            broken.add(PRECONDITION)
    elif expected is OMIT or expected != current:
        broken.add(PRECONDITION)  # whole-value compare, never an unconditional overwrite
    if broken:
        raise Refusal(broken)


def listed_to(viewer: str, watches: dict[str, Any]) -> dict[str, tuple]:
    """§8.5 for human watchers: yourself fully (muted too); another's only when published, never
    muted; mentions_only and cleared are "not subscribed" to everyone."""
    out = {}
    for watcher, current in watches.items():
        value = current["value"]
        if value is None or value["level"] == "mentions_only":
            continue
        if watcher == viewer or (value["level"] != "muted" and value.get("level_public") is True):
            out[watcher] = (value["level"], value.get("level_public"))
    return out


@dataclass
class StrandModel:
    tracks: dict[str, dict]
    stage: str | None = None
    version: int = 1
    watches: dict[str, dict] = field(default_factory=dict)  # member -> {"revision", "value"}

    def current_watch(self, member: str) -> Any:
        return self.watches[member]["value"] if member in self.watches else NEVER


# --- strategies ----------------------------------------------------------------------------------------------

def _op(key: str, malformed: bool = False):
    if malformed:
        return st.sampled_from([{"$op": "set", "value": "yes"}, {"$op": "replace", "value": True}, {"value": True},
                                {"$op": "unset", "value": 1}])
    values = {"enabled": st.booleans(), "is_primary": st.booleans(),
              "profile": st.sampled_from(["review", "support"]), "template": st.just("t1"),
              "metadata": st.sampled_from([{}, {"k": 1}])}[key]
    sets = st.builds(lambda v: {"$op": "set", "value": v}, values)
    if key == "enabled":  # a track is closed with `enabled: set false`; unset is not modelled (§4.7)
        return sets
    return st.one_of(sets, sets, st.just({"$op": "unset"}))


def _entry(names, keys, malformed: bool = False):
    return st.tuples(st.sampled_from(names), st.sampled_from(keys)).flatmap(
        lambda nk: st.tuples(st.just(f"tracks.{nk[0]}.{nk[1]}"),
                             _op(nk[1] if nk[1] in TRACK_FIELDS else "profile", malformed)))


GOOD = _entry(REGISTERED, ("enabled", "is_primary", "enabled", "is_primary", "profile", "template", "metadata"))
# Now and then a malformed entry: an unregistered track, the content path, a whole entry, a bad `$op` or value.
BAD = st.one_of(_entry(("notes",), ("enabled",)), _entry(REGISTERED, ("content",)),
                st.tuples(st.sampled_from(["tracks.discussion", "tracks", "discussion.enabled"]),
                          _op("enabled")),
                _entry(REGISTERED, ("enabled", "is_primary", "profile"), malformed=True))
PATCH = st.lists(st.one_of(*[GOOD] * 8, BAD), min_size=1, max_size=3, unique_by=lambda pair: pair[0]).map(dict)
INITIAL_TRACKS = st.sampled_from([
    {"discussion": {}},
    {"discussion": {}, "synthesis": {}},
    {"synthesis": {}},
    {"discussion": {"is_primary": True}, "synthesis": {"profile": "notes"}},
    {"discussion": {}, "synthesis": {"enabled": False}},
])
LEVEL = st.sampled_from(["mentions_only", "participating", "all", "muted", None])
LEVEL_PUBLIC = st.sampled_from([None, None, True, False])
# How expected_value is given: omitted, the model's exact current value, or another value.
EXPECT = st.one_of(st.just(("omit",)), st.just(("current",)), st.just(("current",)),
                   st.tuples(st.just("value"), st.builds(watch_value, LEVEL, LEVEL_PUBLIC)))


# --- 1. the live server against the model ---------------------------------------------------------------------

async def _calls(url: str, token: str, requests: list[tuple[str, dict]]) -> list[Any]:
    """Each request's result, or the error as (code, reason)."""
    out: list[Any] = []
    async with connect(url) as conn:
        await conn.auth(token=token)
        for op, fields in requests:
            try:
                out.append(await conn.call(op, **fields))
            except ClientError as exc:
                out.append((exc.code, (exc.details or {}).get("reason")))
    return out


async def _login(url: str, email: str) -> str:
    async with connect(url) as conn:
        return (await conn.login(email, MEMBER_PASSWORD))["token"]


def _tracks_view(tracks: dict[str, dict]) -> dict[str, dict]:
    """The model's tracks as StrandInfo shows them (unset options absent)."""
    out = {}
    for name, track in tracks.items():
        view = {"enabled": track["enabled"], "is_primary": track["is_primary"]}
        for key in ("profile", "template"):
            if track[key] is not None:
                view[key] = track[key]
        if track["metadata"]:
            view["metadata"] = track["metadata"]
        out[name] = view
    return out


class StrandMachine(RuleBasedStateMachine):
    numbers = itertools.count(1)
    decisions: Counter = Counter()  # (write, accepted) over every example: both outcomes must be exercised

    def __init__(self, server: ServerThread, tokens: dict[str, str]) -> None:
        super().__init__()
        self.server, self.tokens = server, tokens
        self.ws = {"workspace_id": server.base.workspace_id}
        self.ids = server.base.member_ids
        self.number = next(self.numbers)
        self.model: StrandModel | None = None
        self.stage_changed_at: int | None = None

    def call(self, who: str, op: str, **fields) -> Any:
        return self.server.run(_calls, self.server.base.url, self.tokens[who], [(op, {**fields, **self.ws})])[0]

    def decided(self, step: tuple, answer: Any, expected: Refusal | None) -> bool:
        """The server's decision is the model's; True when the write was accepted."""
        self.decisions[step[0], expected is None] += 1
        if expected is not None:
            assert isinstance(answer, tuple) and answer in expected.allowed, (step, answer, expected.allowed)
            return False
        assert not isinstance(answer, tuple), (step, answer, self.model)
        return True

    @initialize(tracks=INITIAL_TRACKS)
    def create(self, tracks: dict) -> None:
        channel = self.call("O1", "channel.create", slug=f"strand-model-{self.number}", display_name="Model",
                            member_ids=[self.ids["O2"], self.ids["H"]])
        board = self.call("O1", "board.create", channel_id=channel["id"], name="Board")
        created = self.call("O1", "strand.create", board_id=board["id"], title="Modelled", tracks=tracks)
        self.strand_id = created["id"]
        self.model = StrandModel({name: entry(**options) for name, options in tracks.items()})
        assert created["version"] == 1 and "stage" not in created

    @rule(who=st.sampled_from(MEMBERS), patch=PATCH)
    def update_tracks(self, who: str, patch: dict) -> None:
        try:
            after, refusal = patch_tracks(self.model.tracks, patch), None
        except Refusal as exc:
            after, refusal = None, exc
        answer = self.call(who, "strand.tracks.update", strand_id=self.strand_id, patch=patch)
        if self.decided(("tracks", who, patch), answer, refusal):
            self.model.tracks, self.model.version = after, self.model.version + 1

    @rule(who=st.sampled_from(MEMBERS), stage=st.sampled_from(STAGES),
          expected=st.one_of(st.just(OMIT), st.just(None), st.just("current"), st.sampled_from(STAGES)))
    def set_stage(self, who: str, stage: str, expected: Any) -> None:
        if expected == "current":
            expected = self.model.stage if self.model.stage is not None else OMIT
        try:
            check_stage(self.model.stage, expected)
            refusal = None
        except Refusal as exc:
            refusal = exc
        fields = {} if expected is OMIT else {"expected_stage": expected}
        answer = self.call(who, "strand.stage.set", strand_id=self.strand_id, stage=stage, **fields)
        if self.decided(("stage", who, stage, expected), answer, refusal):
            if stage == self.model.stage:
                # A same-value set is a write (version) that does not move stage_changed_at (§3.2).
                assert answer["stage_changed_at_ms"] == self.stage_changed_at, answer
            self.stage_changed_at = answer["stage_changed_at_ms"]
            self.model.stage, self.model.version = stage, self.model.version + 1

    @rule(writer=st.sampled_from(MEMBERS), watcher=st.sampled_from(MEMBERS), level=LEVEL,
          level_public=LEVEL_PUBLIC, how=EXPECT)
    def set_watch(self, writer: str, watcher: str, level: str | None, level_public: bool | None, how: tuple) -> None:
        current = self.model.current_watch(watcher)
        if how[0] == "omit" or (how[0] == "current" and current is NEVER):
            expected = OMIT
        elif how[0] == "current":
            expected = current
        else:
            # An explicit null on a never-written watch is left out: the seed does not settle it.
            expected = how[1] if (how[1] is not None or current is not NEVER) else {"level": "all"}
        try:
            check_watch(writer, watcher, level, level_public, current, expected)
            refusal = None
        except Refusal as exc:
            refusal = exc
        fields: dict[str, Any] = {"level": level}
        if level_public is not None:
            fields["level_public"] = level_public
        if writer != watcher:
            fields["watcher_member_id"] = self.ids[watcher]
        if expected is not OMIT:
            fields["expected_value"] = expected
        answer = self.call(writer, "strand.watch.set", strand_id=self.strand_id, **fields)
        if self.decided(("watch", writer, watcher, fields), answer, refusal):
            revision = self.model.watches[watcher]["revision"] + 1 if watcher in self.model.watches else 1
            value = watch_value(level, level_public)
            self.model.watches[watcher] = {"revision": revision, "value": value}
            assert answer.get("value") == value and answer["revision"] == revision, (answer, revision, value)

    @rule(writer=st.sampled_from(GOVERNORS), other=st.integers(1, 2), level=LEVEL, level_public=LEVEL_PUBLIC,
          how=EXPECT)
    def set_others_watch(self, writer: str, other: int, level: str | None, level_public: bool | None,
                         how: tuple) -> None:
        """An owner or admin writes another member's watch (§8.4), more often than chance would."""
        watcher = MEMBERS[(MEMBERS.index(writer) + other) % len(MEMBERS)]
        self.set_watch(writer, watcher, level, level_public, how)

    @invariant()
    def server_shows_the_model(self) -> None:
        if self.model is None:
            return
        model, sid = self.model, self.strand_id
        for member in MEMBERS:
            strand, mine, watchers = self.server.run(_calls, self.server.base.url, self.tokens[member], [
                ("strand.get", {"strand_id": sid, **self.ws}), ("strand.watch.get", {"strand_id": sid, **self.ws}),
                ("strand.watchers", {"strand_id": sid, **self.ws})])
            got_tracks = {name: {k: v for k, v in track.items() if k not in ("content", "revision")}
                          for name, track in strand["tracks"].items()}
            assert got_tracks == _tracks_view(model.tracks), (strand["tracks"], model.tracks)
            assert (strand["primary_track"], strand.get("stage"), strand["version"]) == (
                resolve(model.tracks), model.stage, model.version), (strand, model)
            current = model.current_watch(member)
            if current is NEVER:
                assert mine == {"status": "never_written"}, mine
            else:
                assert (mine["status"], mine["revision"], mine.get("value")) == (
                    "current", model.watches[member]["revision"], current), (mine, model.watches)
            assert strand.get("my_watch") == (current if current is not NEVER else None), strand
            by_id = {self.ids[m]: m for m in MEMBERS}
            shown = {by_id[w["member_id"]]: (w["level"], w.get("level_public")) for w in watchers["watchers"]}
            assert shown == listed_to(member, model.watches), (member, watchers, model.watches)


def test_strand_writes_follow_the_model_on_the_live_server(database_dsn, member_password_hash):
    with people_server(database_dsn, member_password_hash) as server:
        tokens = {who: server.run(_login, server.base.url, f"{who.lower()}@example.com") for who in MEMBERS}
        # First the cases that matter, spelled out (each judged by the model, the state checked after each).
        scripted = StrandMachine(server, tokens)
        on = lambda value: {"$op": "set", "value": value}  # noqa: E731
        for step, args in (
                (scripted.create, ({"discussion": {}, "synthesis": {}},)),
                (scripted.set_watch, ("O1", "O2", "muted", None, ("omit",))),  # .others never mutes
                (scripted.set_watch, ("O1", "O2", "all", None, ("omit",))),
                (scripted.set_watch, ("O1", "O2", "muted", None, ("current",))),  # not even with the right CAS
                (scripted.set_watch, ("O1", "O2", "participating", True, ("current",))),  # nor publishes
                (scripted.set_watch, ("H", "O1", "all", None, ("omit",))),  # an operator: only their own
                (scripted.set_watch, ("O2", "O2", "all", True, ("current",))),
                (scripted.set_watch, ("O2", "O2", "muted", None, ("value", {"level": "all"}))),  # matched whole
                (scripted.set_watch, ("O2", "O2", None, None, ("current",))),
                (scripted.set_watch, ("O2", "O2", "all", None, ("omit",))),  # cleared is still written
                (scripted.set_stage, ("H", "draft", OMIT)),
                (scripted.set_stage, ("H", "draft", "current")),  # same value: stage_changed_at stays
                (scripted.set_stage, ("O1", "done", OMIT)),
                (scripted.set_stage, ("O1", "done", None)),
                (scripted.update_tracks, ("O1", {"tracks.synthesis.enabled": on(False)})),  # the primary, closed
                (scripted.update_tracks, ("O1", {"tracks.synthesis.enabled": on(False),
                                                 "tracks.discussion.is_primary": on(True)})),
                (scripted.update_tracks, ("O2", {"tracks.synthesis.is_primary": on(True)})),  # on a disabled track
                (scripted.update_tracks, ("H", {"tracks.discussion.enabled": on(False)})),
                (scripted.update_tracks, ("H", {"tracks.synthesis.enabled": on(True),
                                                "tracks.discussion.is_primary": {"$op": "unset"}})),
        ):
            step(*args)
            scripted.server_shows_the_model()
        # A track comes into being only by `enabled: set true` in the same patch (§4.3, §4.6).
        structured = StrandMachine(server, tokens)
        for step, args in (
                (structured.create, ({"synthesis": {}},)),
                (structured.update_tracks, ("O1", {"tracks.discussion.is_primary": on(True)})),
                (structured.update_tracks, ("O1", {"tracks.discussion.profile": on("review")})),
                (structured.update_tracks, ("H", {"tracks.discussion.enabled": on(True),
                                                "tracks.discussion.is_primary": on(True)})),
        ):
            step(*args)
            structured.server_shows_the_model()
        # No shrinking: examples share the server, a replay would not see the same state.
        run_state_machine_as_test(lambda: StrandMachine(server, tokens), settings=settings(
            max_examples=10, stateful_step_count=16, deadline=None, derandomize=True,
            phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck)))
    decisions = StrandMachine.decisions
    print("strand model decisions:", dict(decisions))
    assert all(decisions[write, accepted] >= 5 for write in ("tracks", "stage", "watch")
               for accepted in (True, False)), decisions


# --- 2. the pure rules against the model -----------------------------------------------------------------------

def _domain_tracks(tracks: dict[str, dict]) -> domain.Tracks:
    return {name: domain.Track(**track) for name, track in tracks.items()}


def _from_domain(tracks: domain.Tracks) -> dict[str, dict]:
    return {name: {"enabled": t.enabled, "is_primary": t.is_primary, "profile": t.profile, "template": t.template,
                   "metadata": t.metadata} for name, t in tracks.items()}


@settings(max_examples=200, deadline=None, derandomize=True)
@given(initial=INITIAL_TRACKS, patches=st.lists(PATCH, min_size=1, max_size=6))
def test_tracks_rules_match_the_model(initial, patches):
    tracks = {name: entry(**options) for name, options in initial.items()}
    assert _from_domain(domain.tracks_from_json(initial)) == tracks
    for patch in patches:
        try:
            expected, refusal = patch_tracks(tracks, patch), None
        except Refusal as exc:
            expected, refusal = None, exc
        try:
            got = _from_domain(domain.apply_tracks_patch(_domain_tracks(tracks), patch))
        except domain.StrandRuleError as exc:
            assert refusal is not None and (exc.code, exc.reason) in refusal.allowed, (patch, tracks, exc.reason)
            continue
        assert refusal is None, (patch, tracks, refusal.allowed)
        assert got == expected
        assert domain.resolve_primary(_domain_tracks(got)) == resolve(got)
        tracks = got


@settings(max_examples=300, deadline=None, derandomize=True)
@given(current=st.one_of(st.none(), st.sampled_from(STAGES)), stage=st.sampled_from(STAGES),
       expected=st.one_of(st.just(OMIT), st.none(), st.sampled_from(STAGES)))
def test_stage_rules_match_the_model(current, stage, expected):
    try:
        check_stage(current, expected)
        refusal = None
    except Refusal as exc:
        refusal = exc
    try:
        domain.check_stage_set(current, stage, expected is not OMIT, None if expected is OMIT else expected)
    except domain.StrandRuleError as exc:
        assert refusal is not None and (exc.code, exc.reason) in refusal.allowed
        return
    assert refusal is None


@settings(max_examples=400, deadline=None, derandomize=True)
@given(writer=st.sampled_from(MEMBERS), watcher=st.sampled_from(MEMBERS), level=LEVEL, level_public=LEVEL_PUBLIC,
       current=st.one_of(st.just(NEVER), st.builds(watch_value, LEVEL, LEVEL_PUBLIC)),
       expected=st.one_of(st.just(OMIT), st.builds(watch_value, LEVEL, LEVEL_PUBLIC)))
def test_watch_rules_match_the_model(writer, watcher, level, level_public, current, expected):
    if current is NEVER and expected is None:
        return  # explicit null on a never-written watch: not settled by the seed
    try:
        check_watch(writer, watcher, level, level_public, current, expected)
        refusal = None
    except Refusal as exc:
        refusal = exc
    try:
        value = domain.watch_value(level, level_public)
        written = None if current is NEVER else (
            domain.WatchValue(None) if current is None else domain.WatchValue(current["level"],
                                                                              current.get("level_public")))
        domain.check_watch_write(writer, watcher, value, written, expected is not OMIT,
                                 None if expected is OMIT else domain.expected_watch(expected), writer in GOVERNORS)
    except domain.StrandRuleError as exc:
        assert refusal is not None and (exc.code, exc.reason) in refusal.allowed, (exc.reason, refusal.allowed)
        return
    assert refusal is None


def test_watch_projection_matches_the_model():
    levels = ["mentions_only", "participating", "all", "muted", None]
    for level, public, is_self in itertools.product(levels, [None, True, False], [True, False]):
        watches = {"W": {"revision": 1, "value": watch_value(level, public)}}
        expected = "W" in listed_to("W" if is_self else "V", watches)
        assert domain.projected(level, public, "human", is_self) == expected, (level, public, is_self)
        # An agent's level is public without opt-in (§8.6), muted still hidden from others.
        agent_listed = level not in (None, "mentions_only") and (is_self or level != "muted")
        assert domain.projected(level, public, "agent", is_self) == agent_listed
