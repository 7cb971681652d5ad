"""What a client needs to know beyond the frame shapes: the behaviour the
generated documents (protocol.schema.json, asyncapi.json) describe in words.

Each statement here is checked by a test (tests/test_protocol_contract.py),
so the text cannot drift from the server."""

from __future__ import annotations

# Which stable error code each failure answers (the `code` of the `error` frame).
ERROR_CASES: dict[str, str] = {
    "login with an unknown email or a wrong password": "unauthenticated",
    "auth with a malformed, forged, expired or revoked session token or API key": "unauthenticated",
    "any workspace op before authenticating": "unauthenticated",
    "hello with a protocol_version the server does not speak (details.supported lists the ones it does)": "invalid",
    "a write (message.send, reaction.add, ...) with an API key lacking the `write` scope": "forbidden",
    "scope.invite into a DM (a DM's roster is fixed; details.reason = dm_roster_is_fixed)": "forbidden",
    "not JSON / MessagePack, not an object, a missing required field, a value of the wrong type, or a value "
    "breaking a constraint the schema states (length, pattern, range, enum, unknown field)": "bad_frame",
    "an `op` the server does not know": "unknown_op",
    "a well-typed value breaking an input rule the schema cannot state (see input_rules: NUL, invisible "
    "characters in names, reserved or too deep/large metadata, a message_type other than text/markdown), "
    "a malformed id, or an argument that makes no sense together (e.g. before_seq with after_seq)": "invalid",
}

AUTH_FLOW = (
    "Authentication is in-band, on the open WebSocket: the first frames may be `ping` and `hello` (optional: "
    "agree on protocol_version), then one of `login` (email + password: returns a session token, and "
    "authenticates the connection), `auth` (exactly one of `token` — a session token — or `api_key`) or "
    "`invitation.accept`. Every other op before that answers `unauthenticated`; a connection that does not "
    "authenticate within the server's auth timeout is closed with 4401. A session token or key that is revoked "
    "or expires later closes the connection with 4403; until that close arrives, every command re-checks the "
    "credential and the membership (a `message.send` inside its own write), so a command that arrives after "
    "the revocation committed is refused. A session may act in every workspace it belongs to "
    "(name one with `workspace_id`; without it a multi-workspace session answers `workspace_required`); an "
    "API key is bound to its workspace and member."
)

CONNECTION_RULES = (
    "An error reply never closes the connection: after bad_frame, unknown_op, invalid or any other error "
    "answer the next frame is read as usual. The reply carries the request's `id` when it could be recovered "
    "from the frame (`id` is absent otherwise); an error without a request behind it (the authentication "
    "timeout) comes just before a close."
    " The server answers the requests of one connection as if one at a time, in the order received: replies to "
    "pipelined requests come back in request order (`event` frames may arrive between them), and each request "
    "sees the effects of every request before it. Consecutive `message.send` requests into one scope overlap "
    "without that being visible: once a client has written its next request before a send was answered, "
    "each send is read as soon as the one before it has its place in the scope's order, so sends written "
    "without waiting for replies commit together, still in request order and each re-checked in its own write."
    " Close codes are listed under close_codes; a closed connection resumes by reconnecting, authenticating "
    "and subscribing again with its cursors."
)

SUBSCRIBE_CURSORS = (
    "subscribe.scopes[].after_seq: every message of the scope with seq > after_seq is replayed in seq order "
    "before live events, with no gap and no duplicate. Omitted: live from now: the cursor is the scope's tail "
    "at subscribe time, returned as scopes[].latest_seq in the result; every message after it is delivered."
    " after_global_seq (with workspace_feed: true) does the same for the workspace feed by workspace_global_seq; "
    "omitted, the feed is live from the workspace's tail at subscribe time, returned as workspace_global_seq in "
    "the result. A message of a scope followed on its own is delivered once, by that scope's cursor."
    " To resume after a disconnect, keep the seq and global_seq of the last message event you processed (or "
    "the subscribe result's values when none arrived) and pass them as after_seq / after_global_seq."
)

HISTORY = (
    "A member of a scope reads its whole history, including messages sent before it joined (message.history, "
    "message.get, the subscribe replay). Reading needs current membership: a public channel you have not "
    "joined answers `forbidden` (join first), a scope you cannot see answers `not_found`; a private agent "
    "reads only what the owner-private visibility predicate allows."
)

# Rate budgets per token bucket: (refill per second, burst).  Over budget a
# command answers `rate_limited` (it is never accepted and dropped).
BUDGETS: dict[str, tuple[float, int, str]] = {
    "typing": (1.0, 5, "per member and scope"),
    "presence": (0.2, 3, "per member"),
    "reaction.add / reaction.remove": (5.0, 20, "per member"),
}
TYPING_TTL_MS = 6_000      # a typing signal's expires_at_ms is the send time plus this
PRESENCE_TTL_MS = 90_000   # a presence signal's expires_at_ms is the send time plus this

MENTIONS = (
    "metadata.mentions (server-computed, never client-supplied: a client sending it gets `invalid`) is the "
    "list of member ids the message's live @handle tokens address, in order of first appearance; present only "
    "when there is at least one (and `metadata` itself is left out when empty). A token is `@` followed by an "
    "ASCII handle ([A-Za-z0-9][A-Za-z0-9_.-]*, matched lowercased) outside code spans, fenced code blocks and "
    "blockquotes; at most 50 distinct tokens count. A mention that may not route (an unknown handle, a private "
    "agent the sender may not reach) stays plain text and is not listed. A listed private agent that is a "
    "private member of the parent channel but not of this thread or strand is admitted into it by that "
    "message (a private membership; it then reads only what the owner-private predicate allows, and never "
    "the strand row itself). A forward of several messages and "
    "owner_quote carry no live mentions. metadata.silent is true for a `silent` send."
)

HANDLES = (
    "Every member has a handle unique in its workspace, matching ^[a-z0-9]([a-z0-9_.-]{0,62}[a-z0-9_])?$ for "
    "agents and services. Humans get one from their email: the local part lowercased, every character other "
    "than ASCII letters, digits, `_`, `.` and `-` replaced by `-`, leading/trailing `-_.` stripped, cut to 48 "
    "characters, `user` when nothing is left; when taken in the workspace, `-2`, `-3`, ... is appended. "
    "Agents (agent.create, or the CLI's member create-agent) and services (the CLI's member create-service) "
    "name their handle; a taken handle answers `conflict`. No op changes a handle."
)

# Checked by tests/test_cluster_nodes.py and tests/test_cluster_processes.py.
NODES = (
    "A deployment may run several nodes (servers) on one database, each with its own address: connect to any of "
    "them. Every op answers the same on every node, events committed through any node reach subscribers on "
    "every node in the same order, and cursors are the database's, so a client resumes against any node. A "
    "command for a scope (or a platform op for a platform account) whose owning node has died answers "
    "`unavailable` (retry: a message.send with the same client_message_id, a platform.broadcast.create with the "
    "same client_broadcast_id, is stored at most once) until another node takes it over, at most the "
    "deployment's node lease (default 10 s) after the last renewal; a node that shuts down cleanly hands its "
    "scopes' commands over instead, so they are answered as usual. Platform operators may connect to any node "
    "too: their ops and platform events are the same everywhere."
)
