"""Property test: what a private agent reads and receives, checked against a
plain-Python model of the owner-private readable predicate (scope-model.md
§3.9, §10; collaborator-policy.md §11 item 9, §12).

Each example is a random program over one workspace — owners O1 and O2, a
plain human H, a service member S, O1's private agents A1 and A1b, O2's
private agent A2 and O1's public agent P1 — with a channel C (everyone a
member, the private agents as private members invited by their owners), two
sibling threads T and T2 under it, and a DM between each private agent and its
owner.  Steps send messages (optionally @mentioning an agent), react, grant and
revoke private authority, add / remove People collaborators (who may also
leave), make agents leave or be removed and re-invited, let expiring windows
lapse, and reconnect with an old cursor.

After every step, each private agent — connected with an API key its owner
created — is checked on every read surface against the model: its live
`message.created` and `reaction.added` events since it subscribed, history,
thread root context, reactions, permalinks, inbox previews and unread counts;
and every sent message's `metadata.mentions` against the model's wake
authority.  At the end of an example: history paged both ways, every
permalink, `visibility.explain` (when the server has it) and a resume from an
old cursor.

The model below is written from the model's text alone; it imports nothing
from storage/ or actors/.  Steps that use ops the server does not have yet are
skipped (see OPTIONAL_OPS).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client import ClientError, connect
from protocol.frames import KNOWN_OPS
from server import tenancy as ops
from server.app import Server
from server.auth import Authenticator
from server.config import ServerConfig
from server.credentials import SessionSigner
from storage import tenancy
from storage.bridge import Database, PoolSettings
from tests.conftest import MEMBER_PASSWORD, add_person

# --- the world's cast -------------------------------------------------------------------------------

HUMANS = ("O1", "O2", "H")
PRIVATE_AGENTS = ("A1", "A1b", "A2")
OWNER_OF = {"A1": "O1", "A1b": "O1", "A2": "O2", "P1": "O1"}
AGENT_OWNERS = ("O1", "O2")
HANDLES = {"A1": "pa1", "A1b": "pa1b", "A2": "pa2", "P1": "pub1", "S": "svc1"}
AUTHORS = ("O1", "O2", "H", "S", "A1", "A1b", "A2", "P1")
MENTION_TARGETS = (None, "A1", "A1b", "A2", "P1")
GRANTEES = ("H", "O1", "O2", "S", "P1", "A1", "A1b", "A2")
COLLABORATORS = ("H", "O1", "O2", "S")  # People: humans and service members, never agents
SCOPES = ("C", "T", "T2")
DM_OF = {agent: f"D{agent}" for agent in PRIVATE_AGENTS}
REACTION_KEYS = ("👍", ":ok:", "🎉")
EXPIRIES = (None, None, "soon", "later")
SOON_MS = 700  # an expiring window lapses within the example; "later" never does
LATER_MS = 3_600_000
# A mention whose authority window expires this close to the send may go either way.
EXPIRY_AMBIGUITY_MS = 150
WAIT_SECONDS = 10  # bound on waiting for a pushed event that the protocol guarantees

OPTIONAL_OPS = {"grant": "private_grant.create", "revoke": "private_grant.revoke",
                "collab_add": "collaborator.add", "collab_remove": "collaborator.remove",
                "collab_leave": "collaborator.leave", "explain": "visibility.explain"}


# --- the model ----------------------------------------------------------------------------------------

@dataclass
class Interval:
    start: int
    end: int | None = None  # inclusive; None while open

    def contains(self, seq: int) -> bool:
        return self.start <= seq and (self.end is None or seq <= self.end)


@dataclass
class Membership:
    visibility: str
    last_read_seq: int
    intervals: list[Interval] = field(default_factory=list)

    @property
    def open(self) -> bool:
        return bool(self.intervals) and self.intervals[-1].end is None

    def covers(self, seq: int) -> bool:
        return any(interval.contains(seq) for interval in self.intervals)


@dataclass
class Scope:
    name: str
    id: str
    type: str
    parent: str | None = None
    root: Msg | None = None
    latest_seq: int = 0
    members: dict[str, Membership] = field(default_factory=dict)

    def is_open(self, role: str) -> bool:
        membership = self.members.get(role)
        return membership is not None and membership.open

    def open(self, role: str, *, baseline: int | None = None) -> None:
        """Opens an interval after `baseline` (default: the latest seq)."""
        baseline = self.latest_seq if baseline is None else baseline
        visibility = "private" if role in PRIVATE_AGENTS else "public"
        membership = self.members.setdefault(role, Membership(visibility, baseline))
        assert not membership.open, f"{role} already in {self.name}"
        membership.last_read_seq = baseline
        membership.intervals.append(Interval(baseline + 1))

    def close(self, role: str) -> None:
        self.members[role].intervals[-1].end = self.latest_seq


@dataclass(eq=False)
class Msg:
    id: str
    scope: str
    seq: int
    gseq: int
    author: str
    created_ms: int
    content: str
    reactions: set[tuple[str, str]] = field(default_factory=set)  # (role, key)


@dataclass(eq=False)
class Window:
    """A private grant or a People collaborator row: the author's window in
    workspace_global_seq, cut by time at its expiry."""

    id: str
    kind: str  # grant | collaborator
    owner: str
    member: str
    scope: str
    from_gseq: int
    expires_ms: int | None
    to_gseq: int | None = None

    def covers(self, message: Msg) -> bool:
        return (self.from_gseq <= message.gseq and (self.to_gseq is None or message.gseq <= self.to_gseq)
                and (self.expires_ms is None or message.created_ms < self.expires_ms))

    def ended(self) -> bool:
        return self.to_gseq is not None

    def expired_by(self, now_ms: int) -> bool:
        return self.expires_ms is not None and self.expires_ms <= now_ms


class Model:
    """Scopes, memberships, messages and authority windows, and the predicate over them."""

    def __init__(self) -> None:
        self.scopes: dict[str, Scope] = {}
        self.messages: list[Msg] = []
        self.windows: list[Window] = []
        self.global_seq = 0  # the workspace counter: every message of the workspace is sent here

    def chain(self, scope: str) -> list[str]:
        parent = self.scopes[scope].parent
        return [scope] if parent is None else [scope, parent]

    def readable(self, viewer: str, message: Msg) -> tuple[str, set[str]] | None:
        """(visibility_reason, the ids of the windows that match) for a private
        viewer, or None: first match wins."""
        scope = self.scopes[message.scope]
        membership = scope.members.get(viewer)
        if membership is None or not membership.open or membership.visibility != "private":
            return None
        if not membership.covers(message.seq):
            return None
        owner, author = OWNER_OF[viewer], message.author
        if _LEGACY:
            return "membership", set()
        if author == viewer:
            return "own_output", set()
        if author == owner:
            return "owner", set()
        if author in PRIVATE_AGENTS and OWNER_OF[author] == owner:
            other = scope.members.get(author)
            if other is not None and other.visibility == "private" and other.covers(message.seq):
                return "same_owner_agent", set()
        chain = self.chain(message.scope)
        for kind in ("grant", "collaborator"):
            matching = {w.id for w in self.windows if w.kind == kind and w.owner == owner and w.member == author
                        and w.scope in chain and w.covers(message)}
            if matching:
                return kind, matching
        return None

    def readable_ids(self, viewer: str, scope: str) -> list[str]:
        return [m.id for m in self.messages if m.scope == scope and self.readable(viewer, m)]

    def public_reads(self, role: str, message: Msg) -> bool:
        return role not in PRIVATE_AGENTS and self.scopes[message.scope].is_open(role)

    def authority(self, author: str, target: str, scope: str, lo_ms: int, hi_ms: int) -> bool | None:
        """May `author` wake private agent `target` in `scope` during [lo_ms, hi_ms]?
        None: an expiring window decides, and it lapsed about then."""
        owner = OWNER_OF[target]
        if author == owner:
            return True
        if _LEGACY:
            return False
        if (author in PRIVATE_AGENTS and OWNER_OF[author] == owner
                and self.scopes[scope].members[author].visibility == "private" and self.scopes[scope].is_open(author)):
            return True
        chain = self.chain(scope)
        live = [w for w in self.windows if w.owner == owner and w.member == author and w.scope in chain
                and not w.ended()]
        if any(w.expires_ms is None or w.expires_ms > hi_ms + EXPIRY_AMBIGUITY_MS for w in live):
            return True
        if any(w.expires_ms > lo_ms - EXPIRY_AMBIGUITY_MS for w in live):
            return None
        return False

    def placement(self, target: str, scope: str) -> str | None:
        """'member' when the target is in the scope, 'admission' when a mention
        would admit it into this thread, else None (the mention stays plain)."""
        state = self.scopes[scope]
        if state.is_open(target):
            return "member"
        if state.parent is not None and self.scopes[state.parent].is_open(target):
            return "admission"
        return None

    def mention_outcome(self, author: str, target: str, scope: str, lo_ms: int, hi_ms: int) -> bool | None:
        if self.placement(target, scope) is None:
            return False
        if target not in PRIVATE_AGENTS:
            return True
        return self.authority(author, target, scope, lo_ms, hi_ms)

    def unread(self, viewer: str, scope: str) -> int:
        membership = self.scopes[scope].members[viewer]
        return sum(1 for m in self.messages if m.scope == scope and m.seq > membership.last_read_seq
                   and m.author != viewer and self.readable(viewer, m))


# --- the live harness ---------------------------------------------------------------------------------

class Collector:
    """Reads one connection's pushes in the background and remembers them."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.created: list[str] = []
        self.created_ids: set[str] = set()
        self.reactions: set[tuple[str, str, str]] = set()
        self._changed = trio.Event()

    async def run(self) -> None:
        while True:
            try:
                event = await self.conn.next_event()
            except Exception:  # the connection closed
                return
            if event["event"] == "message.created":
                self.created.append(event["data"]["id"])
                self.created_ids.add(event["data"]["id"])
            elif event["event"] == "reaction.added":
                data = event["data"]
                self.reactions.add((data["message_id"], data["key"], data["member_id"]))
            self._changed.set()
            self._changed = trio.Event()

    async def wait_for(self, condition, seconds: float = WAIT_SECONDS) -> bool:
        with trio.move_on_after(seconds):
            while not condition():
                await self._changed.wait()
            return True
        return False


@dataclass
class Party:
    role: str
    member_id: str
    conn: object
    api_key: str | None = None


class World:
    def __init__(self, server: Server, workspace_id: str, nursery: trio.Nursery) -> None:
        self.server = server
        self.workspace_id = workspace_id
        self.nursery = nursery
        self.model = Model()
        self.parties: dict[str, Party] = {}
        self.collectors: dict[str, Collector] = {}
        self.live_from: dict[str, int] = {}
        self.expected_created: dict[str, set[str]] = {a: set() for a in PRIVATE_AGENTS}
        self.expected_reactions: dict[str, set[tuple[str, str, str]]] = {a: set() for a in PRIVATE_AGENTS}
        self.unchecked: list[Msg] = []  # permalinks not checked yet
        self.steps = itertools.count(1)
        self.waited_for_expiry = 0
        self.has = {name: op in KNOWN_OPS for name, op in OPTIONAL_OPS.items()}

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.server.port}"

    def role_of(self, member_id: str) -> str:
        return next((p.role for p in self.parties.values() if p.member_id == member_id), member_id)

    def id_of(self, role: str) -> str:
        return self.parties[role].member_id

    async def call(self, role: str, op: str, **fields):
        return await self.parties[role].conn.call(op, workspace_id=self.workspace_id, **fields)

    async def server_now_ms(self) -> int:
        return (await self.call("O1", "ping"))["server_time_ms"]

    # --- recording what the server did, in the model ------------------------------------------

    def record(self, info: dict, scope: str, author: str) -> Msg:
        state = self.model.scopes[scope]
        assert info["seq"] == state.latest_seq + 1, (scope, info["seq"], state.latest_seq)
        assert info["global_seq"] == self.model.global_seq + 1, (info["global_seq"], self.model.global_seq)
        message = Msg(info["id"], scope, info["seq"], info["global_seq"], author, info["created_at_ms"],
                      info["content"])
        state.latest_seq = message.seq
        self.model.global_seq = message.gseq
        self.model.messages.append(message)
        self.unchecked.append(message)
        return message

    def expect_live(self, message: Msg) -> None:
        """Right after commit: which subscribed private agents must receive it."""
        for agent in PRIVATE_AGENTS:
            if message.gseq > self.live_from[agent] and self.model.readable(agent, message):
                self.expected_created[agent].add(message.id)

    # --- steps ------------------------------------------------------------------------------------

    async def send(self, author: str, scope: str, target: str | None) -> None:
        model = self.model
        state = model.scopes[scope]
        if target == author or not self._may_write(author, scope):
            return
        content = f"step {next(self.steps)}" + (f" @{HANDLES[target]}" if target else "")
        joins = state.parent is not None and not state.is_open(author)
        lo_ms = int(time.time() * 1000)
        if state.parent is None:
            info = await self.call(author, "message.send", scope_id=state.id, content=content)
        else:
            info = await self.call(author, "thread.reply", scope_id=model.scopes[state.parent].id,
                                   root_message_id=state.root.id, content=content)
        hi_ms = int(time.time() * 1000)
        assert info["scope_id"] == state.id
        if joins:  # replying joined the thread first
            state.open(author)
        message = self.record(info, scope, author)
        mentions = info.get("metadata", {}).get("mentions", [])
        if target is not None:
            expected = model.mention_outcome(author, target, scope, lo_ms, hi_ms)
            mentioned = self.id_of(target) in mentions
            assert expected is None or mentioned == expected, (
                f"{author} mentioning {target} in {scope}: the model says "
                f"{'live' if expected else 'plain text'}, metadata.mentions={mentions}")
            if mentioned and model.placement(target, scope) == "admission":
                state.open(target, baseline=message.seq - 1)  # admitted with the admitting message
        else:
            assert mentions == [], mentions
        self.expect_live(message)

    def _may_write(self, author: str, scope: str) -> bool:
        model = self.model
        state = model.scopes[scope]
        if state.parent is None:
            return state.is_open(author)
        if not model.scopes[state.parent].is_open(author):
            return False
        if author in PRIVATE_AGENTS:
            # A private agent enters a thread only by authorized mention; replying
            # must not be a way in, so only members reply (and read the root).
            return state.is_open(author) and model.readable(author, state.root) is not None
        return True

    async def react(self, reactor: str, index: int, key: str) -> None:
        model = self.model
        candidates = [m for m in model.messages if model.public_reads(reactor, m)]
        if not candidates:
            return
        message = candidates[index % len(candidates)]
        await self.call(reactor, "reaction.add", message_id=message.id, key=key)
        if (reactor, key) in message.reactions:
            return
        message.reactions.add((reactor, key))
        for agent in PRIVATE_AGENTS:
            if model.readable(agent, message):
                self.expected_reactions[agent].add((message.id, key, self.id_of(reactor)))

    async def _expiry_ms(self, choice: str | None) -> int | None:
        if choice is None:
            return None
        return await self.server_now_ms() + (SOON_MS if choice == "soon" else LATER_MS)

    async def grant(self, owner: str, grantee: str, scope: str, expiry: str | None) -> None:
        model = self.model
        if not self.has["grant"] or grantee == owner or not model.scopes[scope].is_open(owner):
            return
        now_ms = await self.server_now_ms()
        if any(w.kind == "grant" and (w.owner, w.member, w.scope) == (owner, grantee, scope) and not w.ended()
               and not w.expired_by(now_ms) for w in model.windows):
            return
        expires_ms = await self._expiry_ms(expiry)
        fields = {"expires_at_ms": expires_ms} if expires_ms is not None else {}
        info = await self.call(owner, "private_grant.create", scope_id=model.scopes[scope].id,
                               grantee_member_id=self.id_of(grantee), **fields)
        assert info["effective_from_global_seq"] == model.global_seq + 1, info
        model.windows.append(Window(info["id"], "grant", owner, grantee, scope, model.global_seq + 1, expires_ms))

    async def revoke(self, index: int) -> None:
        model = self.model
        live = [w for w in model.windows if w.kind == "grant" and not w.ended()]
        if not self.has["revoke"] or not live:
            return
        window = live[index % len(live)]
        info = await self.call(window.owner, "private_grant.revoke", grant_id=window.id)
        assert info["effective_to_global_seq"] == model.global_seq, info
        window.to_gseq = model.global_seq

    async def collaborator_add(self, owner: str, member: str, scope: str, expiry: str | None) -> None:
        model = self.model
        if not self.has["collab_add"] or member == owner or not model.scopes[scope].is_open(owner):
            return
        now_ms = await self.server_now_ms()
        rows = [w for w in model.windows if w.kind == "collaborator" and (w.owner, w.member, w.scope) == (
            owner, member, scope) and not w.ended()]
        if any(not w.expired_by(now_ms) for w in rows):
            return
        expires_ms = await self._expiry_ms(expiry)
        fields = {"expires_at_ms": expires_ms} if expires_ms is not None else {}
        if model.scopes[scope].type == "channel":
            fields["confirm_channel"] = True
            if expires_ms is None:
                fields["no_expiry"] = True
        try:
            info = await self.call(owner, "collaborator.add", scope_id=model.scopes[scope].id,
                                   member_id=self.id_of(member), **fields)
        except ClientError as exc:
            # An expired row the sweep has not ended yet may still hold the active key.
            assert rows and exc.code == "conflict", exc
            return
        assert info["effective_from_global_seq"] == model.global_seq + 1, info
        model.windows.append(Window(info["id"], "collaborator", owner, member, scope, model.global_seq + 1,
                                    expires_ms))

    async def collaborator_end(self, index: int, by_member: bool) -> None:
        model = self.model
        live = [w for w in model.windows if w.kind == "collaborator" and not w.ended()]
        if not live or not self.has["collab_leave" if by_member else "collab_remove"]:
            return
        window = live[index % len(live)]
        actor, op = (window.member, "collaborator.leave") if by_member else (window.owner, "collaborator.remove")
        try:
            info = await self.call(actor, op, collaborator_id=window.id)
        except ClientError:
            # Ending a row that has already expired changes nothing the predicate sees.
            assert window.expired_by(await self.server_now_ms())
            window.to_gseq = model.global_seq
            return
        if info.get("effective_to_global_seq") is not None and info.get("end_reason") != "expired":
            assert info["effective_to_global_seq"] == model.global_seq, info
        window.to_gseq = model.global_seq

    async def agent_leave(self, agent: str, scope: str, by_owner: bool) -> None:
        state = self.model.scopes[scope]
        if not state.is_open(agent):
            return
        owner = OWNER_OF[agent]
        if by_owner and state.is_open(owner):
            await self.call(owner, "scope.remove", scope_id=state.id, member_id=self.id_of(agent))
        else:
            await self.call(agent, "scope.leave", scope_id=state.id)
        state.close(agent)

    async def agent_rejoin(self, agent: str) -> None:
        channel = self.model.scopes["C"]
        if channel.is_open(agent):
            return
        await self.call(OWNER_OF[agent], "scope.invite", scope_id=channel.id, member_ids=[self.id_of(agent)])
        channel.open(agent)

    async def let_expire(self) -> None:
        """Let every pending expiry lapse (a sleep of at most SOON_MS, twice per example)."""
        now_ms = await self.server_now_ms()
        pending = [w.expires_ms for w in self.model.windows
                   if w.expires_ms is not None and now_ms < w.expires_ms <= now_ms + SOON_MS]
        if not pending or self.waited_for_expiry >= 2:
            return
        self.waited_for_expiry += 1
        await trio.sleep((max(pending) - now_ms + 20) / 1000)

    # --- the checks -------------------------------------------------------------------------------

    async def sentinel(self, agent: str, conn=None) -> Msg:
        """The agent writes in its DM.  The workspace feed is delivered in
        global-seq order, so once this arrives every earlier readable message has."""
        state = self.model.scopes[DM_OF[agent]]
        conn = conn or self.parties[agent].conn
        info = await conn.call("message.send", workspace_id=self.workspace_id, scope_id=state.id,
                               content=f"sentinel {next(self.steps)}")
        message = self.record(info, state.name, agent)
        self.expect_live(message)
        return message

    async def check_live(self, agent: str, sentinel: Msg) -> None:
        collector = self.collectors[agent]
        assert await collector.wait_for(lambda: sentinel.id in collector.created_ids), \
            f"{agent} never received its own sentinel"
        expected = self.expected_created[agent]
        self._compare(f"live message.created of {agent}", expected, collector.created_ids)
        assert len(collector.created) == len(collector.created_ids), f"{agent} received a message twice"
        # Reaction events have no seq to order them by: wait (bounded) for the missing ones.
        wanted = self.expected_reactions[agent]
        await collector.wait_for(lambda: wanted <= collector.reactions, 2)
        self._compare(f"live reaction.added of {agent}", wanted, collector.reactions)

    def _compare(self, surface: str, expected: set, got: set) -> None:
        if expected == got:
            return
        by_id = {m.id: m for m in self.model.messages}

        def show(item) -> str:
            message_id = item[0] if isinstance(item, tuple) else item
            m = by_id.get(message_id)
            if m is None:
                return repr(item)
            extra = f" reaction {item[1]} by {self.role_of(item[2])}" if isinstance(item, tuple) else ""
            return f"{m.scope}#{m.seq} by {m.author} {m.content!r}{extra}"

        missing = sorted(show(i) for i in expected - got)
        extra = sorted(show(i) for i in got - expected)
        raise AssertionError(f"{surface}: missing {missing}, not allowed {extra}")

    async def check_reads(self, agent: str, *, permalinks: list[Msg], paged: bool = False) -> None:
        model = self.model
        for name, state in model.scopes.items():
            if name.startswith("D") and name != DM_OF[agent]:
                continue
            if not state.is_open(agent):
                code = "forbidden" if name == "C" else "not_found"
                try:
                    await self.call(agent, "message.history", scope_id=state.id)
                except ClientError as exc:
                    assert exc.code == code, (agent, name, exc)
                else:
                    raise AssertionError(f"{agent} read the history of {name} without a membership")
                continue
            expected = model.readable_ids(agent, name)
            page = await self.call(agent, "message.history", scope_id=state.id, limit=200)
            self._check_page(agent, name, page, expected, has_more=False)
            if paged:
                await self._check_paging(agent, name, expected)
        for message in permalinks:
            try:
                detail = await self.call(agent, "message.get", message_id=message.id)
            except ClientError as exc:
                assert exc.code == "not_found", exc
                assert not model.readable(agent, message), (
                    f"message.get: {agent} cannot read {message.scope}#{message.seq} by {message.author}")
            else:
                assert model.readable(agent, message), (
                    f"message.get: {agent} read {message.scope}#{message.seq} by {message.author}")
                self._check_reactions(agent, message, detail["message"])

    def _check_page(self, agent: str, scope: str, page: dict, expected: list[str], *, has_more: bool) -> None:
        by_id = {m.id: m for m in self.model.messages}
        got = [m["id"] for m in page["messages"]]
        self._compare(f"history of {scope} for {agent}", set(expected), set(got))
        assert got == expected, (agent, scope, "out of order")
        assert page["has_more"] == has_more
        for info in page["messages"]:
            self._check_reactions(agent, by_id[info["id"]], info)
        root = self.model.scopes[scope].root
        if root is not None:
            readable = self.model.readable(agent, root) is not None
            shown = page.get("root")
            assert (shown is not None) == readable, (
                f"thread root of {scope} for {agent}: model says {'readable' if readable else 'hidden'}")
            if shown is not None:
                assert shown["id"] == root.id
                self._check_reactions(agent, root, shown)

    def _check_reactions(self, agent: str, message: Msg, info: dict) -> None:
        if not self.model.readable(agent, message):
            return
        counts: dict[str, list] = {}
        for role, key in message.reactions:
            entry = counts.setdefault(key, [0, False])
            entry[0] += 1
        got = {r["key"]: [r["count"], r["me"]] for r in info.get("reactions", [])}
        assert got == counts, (agent, message.scope, message.seq, got, counts)

    async def _check_paging(self, agent: str, scope: str, expected: list[str]) -> None:
        state = self.model.scopes[scope]
        seq_of = {m.id: m.seq for m in self.model.messages}
        forward, cursor = [], 0
        while True:
            page = await self.call(agent, "message.history", scope_id=state.id, after_seq=cursor, limit=2)
            forward += [m["id"] for m in page["messages"]]
            if not page["has_more"]:
                break
            cursor = page["messages"][-1]["seq"]
        assert forward == expected, f"{agent} paging {scope} forward"
        backward, before = [], None
        while True:
            fields = {"before_seq": before} if before is not None else {}
            page = await self.call(agent, "message.history", scope_id=state.id, limit=2, **fields)
            backward = [m["id"] for m in page["messages"]] + backward
            if not page["has_more"]:
                break
            before = page["messages"][0]["seq"]
        assert backward == expected, f"{agent} paging {scope} backward"
        assert all(seq_of[a] < seq_of[b] for a, b in zip(expected, expected[1:]))

    async def check_inbox(self, agent: str) -> None:
        model = self.model
        page = await self.call(agent, "inbox.list", limit=200)
        rows = {row["scope_id"]: row for row in page["conversations"]}
        names = {state.id: name for name, state in model.scopes.items()}
        expected = {state.id for state in model.scopes.values() if state.is_open(agent)}
        assert set(rows) == expected, (agent, sorted(names.get(s, s) for s in rows))
        for scope_id, row in rows.items():
            name = names[scope_id]
            readable = [m for m in model.messages if m.scope == name and model.readable(agent, m)]
            latest = readable[-1] if readable else None
            if row.get("last_message_id") is not None:
                assert latest is not None and row["last_message_id"] == latest.id, (
                    f"inbox preview of {name} for {agent}: "
                    f"{[(m.seq, m.author) for m in model.messages if m.id == row['last_message_id']]}")
                assert row.get("last_preview") == latest.content[:200]
            assert row["unread_count"] == model.unread(agent, name), (
                f"inbox unread of {name} for {agent}: {row['unread_count']} != {model.unread(agent, name)}")

    async def check_explain(self, agent: str) -> None:
        for message in self.model.messages:
            verdict = self.model.readable(agent, message)
            result = await self.call(agent, "visibility.explain", message_id=message.id,
                                     member_id=self.id_of(agent))
            assert result["readable"] == (verdict is not None), (agent, message.scope, message.seq)
            if verdict is not None:
                reason, windows = verdict
                assert result.get("reason") == reason, (agent, message.scope, message.seq, result, reason)
                if windows:
                    assert result.get("grant_id") in windows, (result, windows)

    async def check_resume(self, agent: str, after_global_seq: int, after_seq: int) -> None:
        """A second connection of the agent resumes the feed (and C by seq) from old cursors."""
        model = self.model
        channel = model.scopes["C"]
        async with connect(self.url) as conn:
            await conn.auth(api_key=self.parties[agent].api_key)
            collector = Collector(conn)
            self.nursery.start_soon(collector.run)
            cursors = [{"scope_id": channel.id, "after_seq": after_seq}] if channel.is_open(agent) else []
            await conn.call("subscribe", workspace_id=self.workspace_id, workspace_feed=True,
                            after_global_seq=after_global_seq, scopes=cursors)
            sentinel = await self.sentinel(agent, conn)
            assert await collector.wait_for(lambda: sentinel.id in collector.created_ids)
            expected = {m.id for m in model.messages if model.readable(agent, m) and (
                m.seq > after_seq if m.scope == "C" and cursors else m.gseq > after_global_seq)}
            self._compare(f"resume of {agent} from global seq {after_global_seq} / C seq {after_seq}",
                          expected, collector.created_ids)
        await self.check_live(agent, sentinel)

    async def check_all(self, *, final: bool = False) -> None:
        permalinks = self.model.messages if final else self.unchecked
        self.unchecked = []

        # One at a time: the model numbers messages in commit order.
        sentinels = {agent: await self.sentinel(agent) for agent in PRIVATE_AGENTS}

        async def one(agent: str) -> None:
            await self.check_live(agent, sentinels[agent])
            await self.check_reads(agent, permalinks=permalinks, paged=final)
            await self.check_inbox(agent)
            if final and self.has["explain"]:
                await self.check_explain(agent)

        async with trio.open_nursery() as nursery:
            for agent in PRIVATE_AGENTS:
                nursery.start_soon(one, agent)
        self.unchecked = [m for m in self.unchecked if m.scope in DM_OF.values()]


# --- building the world -------------------------------------------------------------------------------

_workspace_numbers = itertools.count(1)


async def _members(db: Database, password_hash: str) -> tuple[str, dict[str, tuple[str, str]]]:
    """A new workspace: O1 (owner), O2 (admin), H (operator) and S; email/member per human."""
    n = next(_workspace_numbers)

    async def unit(conn):
        if await conn.fetchval("SELECT count(*) FROM instance_metadata") == 0:
            return None
        return await tenancy.instance_id(conn)

    instance = await db.run(unit)
    emails = {role: f"{role.lower()}-{n}@example.com" for role in HUMANS}
    if instance is None:
        first = await ops.init_instance(db, email=emails["O1"], display_name="O1", workspace_name=f"PV {n}",
                                        workspace_slug=f"pv-{n}", edition="multi", password=MEMBER_PASSWORD)
        workspace_id, owner_id = first.workspace_id, first.member_id
    else:
        created = await db.transaction(lambda conn: tenancy.create_workspace(
            conn, instance_id=instance, name=f"PV {n}", slug=f"pv-{n}", type="team", owner_email=emails["O1"],
            owner_display_name="O1", owner_password_hash=password_hash, single_edition=False))
        workspace_id, owner_id = created.workspace_id, created.member_id
    people = {"O1": (emails["O1"], owner_id)}
    for role, workspace_role in (("O2", "admin"), ("H", "operator")):
        person = await add_person(db, workspace_id, emails[role], workspace_role, password_hash)
        people[role] = (emails[role], person.member_id)
    service_id = await db.transaction(lambda conn: tenancy.create_agent_or_service(
        conn, workspace_id, kind="service", handle=HANDLES["S"], display_name="S", owner_member_id=None,
        visibility=None))
    people["S"] = (None, service_id)
    return workspace_id, people


async def build_world(server: Server, db: Database, password_hash: str, nursery: trio.Nursery,
                      stack) -> World:
    workspace_id, people = await _members(db, password_hash)
    world = World(server, workspace_id, nursery)
    for role in HUMANS:
        email, member_id = people[role]
        conn = await stack.enter_async_context(connect(world.url))
        await conn.login(email, MEMBER_PASSWORD)
        world.parties[role] = Party(role, member_id, conn)
    for agent in (*PRIVATE_AGENTS, "P1"):
        created = await world.call(OWNER_OF[agent], "agent.create", handle=HANDLES[agent], display_name=agent,
                                   visibility="public" if agent == "P1" else "private")
        people[agent] = (None, created["id"])
    for role in (*PRIVATE_AGENTS, "P1", "S"):
        member_id = people[role][1]
        key = await world.call("O1", "apikey.create", name=role, member_id=member_id)
        conn = await stack.enter_async_context(connect(world.url))
        await conn.auth(api_key=key["key"])
        world.parties[role] = Party(role, member_id, conn, key["key"])
    # Every private agent follows the workspace feed from before the first message.
    for agent in PRIVATE_AGENTS:
        collector = world.collectors[agent] = Collector(world.parties[agent].conn)
        nursery.start_soon(collector.run)
        result = await world.call(agent, "subscribe", workspace_feed=True)
        world.live_from[agent] = result["workspace_global_seq"]
        assert world.live_from[agent] == 0

    model = world.model
    channel = await world.call("O1", "channel.create", slug="c", display_name="C", visibility="public",
                               member_ids=[world.id_of(r) for r in ("O2", "H", "P1", "S")])
    model.scopes["C"] = Scope("C", channel["id"], "channel")
    for role in ("O1", "O2", "H", "P1", "S"):
        model.scopes["C"].open(role)
    for agent in PRIVATE_AGENTS:
        await world.call(OWNER_OF[agent], "scope.invite", scope_id=channel["id"], member_ids=[world.id_of(agent)])
        model.scopes["C"].open(agent)
        dm = await world.call(OWNER_OF[agent], "dm.open", member_id=world.id_of(agent))
        model.scopes[DM_OF[agent]] = Scope(DM_OF[agent], dm["id"], "dm")
        model.scopes[DM_OF[agent]].open(OWNER_OF[agent])
        model.scopes[DM_OF[agent]].open(agent)
    # Two sibling threads: T (root by O2, opened by O1), T2 (root by H, opened by O2).
    for name, root_author, opener in (("T", "O2", "O1"), ("T2", "H", "O2")):
        info = await world.call(root_author, "message.send", scope_id=channel["id"], content=f"root of {name}")
        root = world.record(info, "C", root_author)
        world.expect_live(root)
        reply = await world.call(opener, "thread.reply", scope_id=channel["id"], root_message_id=root.id,
                                 content=f"first in {name}")
        thread = model.scopes[name] = Scope(name, reply["scope_id"], "thread", parent="C", root=root)
        thread.open(opener)
        thread.open(root_author)
        world.expect_live(world.record(reply, name, opener))
    return world


# --- the program ----------------------------------------------------------------------------------------

def _step(name: str, *parts):
    return st.tuples(st.just(name), *parts)


ROLE_INDEX = st.integers(0, 7)
STEP = st.one_of(
    _step("send", st.sampled_from(AUTHORS), st.sampled_from(SCOPES), st.sampled_from(MENTION_TARGETS)),
    _step("send", st.sampled_from(AGENT_OWNERS + ("H",)), st.sampled_from(SCOPES),
          st.sampled_from(PRIVATE_AGENTS)),
    _step("react", st.sampled_from(HUMANS), st.integers(0, 63), st.sampled_from(REACTION_KEYS)),
    _step("grant", st.sampled_from(AGENT_OWNERS), st.sampled_from(GRANTEES), st.sampled_from(SCOPES),
          st.sampled_from(EXPIRIES)),
    _step("revoke", st.integers(0, 15)),
    _step("collab_add", st.sampled_from(AGENT_OWNERS), st.sampled_from(COLLABORATORS), st.sampled_from(SCOPES),
          st.sampled_from(EXPIRIES)),
    _step("collab_end", st.integers(0, 15), st.booleans()),
    _step("agent_leave", st.sampled_from(PRIVATE_AGENTS), st.sampled_from(SCOPES), st.booleans()),
    _step("agent_rejoin", st.sampled_from(PRIVATE_AGENTS)),
    _step("let_expire"),
    _step("resume", st.sampled_from(PRIVATE_AGENTS), st.integers(0, 63), st.integers(0, 63)),
)
PROGRAM = st.lists(STEP, min_size=4, max_size=24)


async def run_step(world: World, step: tuple) -> None:
    kind, *args = step
    if kind == "send":
        await world.send(*args)
    elif kind == "react":
        await world.react(*args)
    elif kind == "grant":
        await world.grant(*args)
    elif kind == "revoke":
        await world.revoke(*args)
    elif kind == "collab_add":
        await world.collaborator_add(*args)
    elif kind == "collab_end":
        await world.collaborator_end(*args)
    elif kind == "agent_leave":
        await world.agent_leave(*args)
    elif kind == "agent_rejoin":
        await world.agent_rejoin(*args)
    elif kind == "let_expire":
        await world.let_expire()
    elif kind == "resume":
        agent, global_index, seq_index = args
        await world.check_resume(agent, global_index % (world.model.global_seq + 1),
                                 seq_index % (world.model.scopes["C"].latest_seq + 1))


async def run_program(dsn: str, password_hash: str, program: list[tuple]) -> None:
    from contextlib import AsyncExitStack

    config = ServerConfig(port=0, auth_timeout_seconds=5.0, expiry_sweep_seconds=0.5, shutdown_grace_seconds=1.0)
    async with Database(dsn, PoolSettings(min_size=1, max_size=10)) as db, trio.open_nursery() as nursery:
        server = Server(config, db, Authenticator(db, SessionSigner(Ed25519PrivateKey.generate()),
                                                 config.session_ttl_seconds))
        await nursery.start(server.run)
        async with AsyncExitStack() as stack:
            world = await build_world(server, db, password_hash, nursery, stack)
            await world.check_all()
            for step in program:
                await run_step(world, step)
                await world.check_all()
            for agent in PRIVATE_AGENTS:
                await world.check_resume(agent, 0, 0)
            await world.check_all(final=True)
        nursery.cancel_scope.cancel()


import os
_LEGACY = os.environ.get("PV_LEGACY") == "1"
from hypothesis import Phase
@settings(phases=[Phase.generate] if os.environ.get("PV_NOSHRINK") else None, max_examples=int(os.environ.get("PV_N", "8")), deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(program=PROGRAM)
def test_private_agents_read_and_receive_what_the_model_allows(database_dsn, member_password_hash, program):
    # Each example is its own trio run with its own server, over one database.
    trio.run(run_program, database_dsn, member_password_hash, program)
