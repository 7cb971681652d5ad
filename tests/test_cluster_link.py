"""The forward link's codec (server/cluster.py): a frame that passed its HMAC is
unpickled with an allow-list, so a peer — or anyone who got hold of the link key —
cannot make a node call a function, a builtin or a third-party class; the actors'
own commands and replies still cross intact.  The codec is tested directly (no
servers); tests/test_cluster_nodes.py sends a hostile frame over a real link."""

from __future__ import annotations

import pickle
from datetime import datetime, timedelta, timezone

import asyncpg
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from actors.scope_actor import ActorUnavailable, Refused, Reply, Send
from domain.plan import ActorContext, CommittedMessage, MentionMode, MessageIntent, SourceRef
from server.cluster import _dumps, _loads
from storage.errors import Conflict, LeaseLost, NotFound


def pickle_calling(module: str, name: str, *args) -> bytes:
    """A pickle that a plain `pickle.loads` runs as `module.name(*args)` (GLOBAL, then REDUCE)."""
    arguments = pickle.dumps(args, protocol=3)[2:-1]  # the tuple's opcodes, without PROTO and STOP
    return b"\x80\x03c" + f"{module}\n{name}\n".encode() + arguments + b"R."


def _touch_eval(marker) -> bytes:
    return pickle_calling("builtins", "eval", f"open({str(marker)!r}, 'w').close()")


def _touch_os_system(marker) -> bytes:
    return pickle_calling("os", "system", f"touch '{marker}'")


def _touch_popen(marker) -> bytes:
    return pickle_calling("subprocess", "Popen", ["touch", str(marker)])


def _touch_nested_pickle_loads(marker) -> bytes:
    # pickle.loads handed a plain pickle that runs os.system: the inner one must never be unpickled.
    return pickle_calling("pickle", "loads", _touch_os_system(marker))


@pytest.mark.parametrize("hostile, refused_name", [
    (_touch_eval, "builtins.eval"),
    (_touch_os_system, "os.system"),
    (_touch_popen, "subprocess.Popen"),
    (_touch_nested_pickle_loads, "pickle.loads"),
])
def test_a_frame_that_calls_a_function_is_refused_and_runs_nothing(tmp_path, hostile, refused_name):
    marker = tmp_path / "ran"
    payload = hostile(marker)
    with pytest.raises(pickle.UnpicklingError, match=refused_name):
        try:
            _loads(payload)
        finally:
            assert not marker.exists(), "the payload ran"
    # The same bytes are live: a plain unpickler runs them (so the refusal above is not a typo's).
    result = pickle.loads(payload)
    if hasattr(result, "wait"):
        result.wait()  # the Popen
    assert marker.exists()


@pytest.mark.parametrize("payload, refused_name", [
    (pickle.dumps(trio.Event(), protocol=5), "trio.Event"),
    (pickle.dumps(asyncpg.Record, protocol=5), "asyncpg.protocol.record.Record"),
    # A reply error the pickler wraps as this project's exception rebuild, naming a foreign class.
    (_dumps(asyncpg.UniqueViolationError("duplicate")), "asyncpg.exceptions.UniqueViolationError"),
], ids=["trio.Event", "asyncpg.Record", "asyncpg exception"])
def test_a_frame_naming_a_third_party_class_is_refused(payload, refused_name):
    with pytest.raises(pickle.UnpicklingError, match=refused_name):
        _loads(payload)


@pytest.mark.parametrize("payload", [
    pickle_calling("server.cluster", "link_key", b"key"),  # a project function
    # A dotted name through a project module's imports, to a third-party exception.
    pickle_calling("server.cluster", "asyncpg.exceptions.UniqueViolationError", "duplicate"),
    pickle_calling("storage.bridge", "Database", "postgresql://nowhere"),  # a project class that is not a data class
    pickle_calling("server.cluster", "_rebuild_exception", ActorContext, ("w", "m", "human", None, 1), {}),
], ids=["function", "dotted name", "plain class", "non-exception rebuild"])
def test_a_project_module_lends_only_its_data_classes(payload):
    with pytest.raises(pickle.UnpicklingError):
        _loads(payload)


def test_a_forwarded_command_crosses_intact():
    actor = ActorContext("ws_1", "mem_1", "agent", "mem_owner", 3, notify_principal_member_id="mem_owner")
    intent = MessageIntent("scp_1", "see above", client_message_id="c-1", metadata={"k": [1, {"n": None}]},
                           sources=(SourceRef("forward", "msg_1", "scp_0", 4),),
                           mention_mode=MentionMode.MULTI_FORWARD, recipients=("mem_2",), attachment_ids=("att_1",))
    command = Send(actor, intent)
    request_id, scope_id, decoded = _loads(_dumps((7, "scp_1", command)))
    assert (request_id, scope_id, type(decoded)) == (7, "scp_1", Send)
    assert decoded.__getstate__() == command.__getstate__()
    assert decoded.intent.mention_mode is MentionMode.MULTI_FORWARD
    # The caller's reply slot stays with the caller; the owner gets a fresh one.
    assert isinstance(decoded.reply, Reply) and decoded.reply is not command.reply


def test_a_reply_value_crosses_intact():
    message = CommittedMessage("msg_1", "ws_1", "scp_1", 5, 99, "mem_1", "human", "text", "hello",
                               {"nested": {"list": [1, 2.5, "x"]}}, "c-1", datetime.now(timezone.utc), revision=2)
    assert _loads(_dumps((7, True, message))) == (7, True, message)


@pytest.mark.parametrize("error", [
    Refused("forbidden", "not yours", reason="role"),
    NotFound("gone"),
    Conflict("duplicate", "already there"),  # an __init__ with other arguments than its args
    LeaseLost("taken over"),
    ActorUnavailable("retry"),
], ids=lambda error: type(error).__name__)
def test_a_reply_error_crosses_intact(error):
    request_id, ok, decoded = _loads(_dumps((7, False, error)))
    assert (request_id, ok, type(decoded)) == (7, False, type(error))
    assert decoded.args == error.args and decoded.__dict__ == error.__dict__


_PLAIN_SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
                  | st.binary() | st.complex_numbers(allow_nan=False) | st.uuids()
                  | st.decimals(allow_nan=False, allow_infinity=False) | st.dates() | st.times() | st.timedeltas()
                  | st.datetimes(timezones=st.none() | st.builds(
                      timezone, st.timedeltas(min_value=timedelta(hours=-23), max_value=timedelta(hours=23)))))
_PLAIN_VALUES = st.recursive(
    _PLAIN_SCALARS | st.binary().map(bytearray),
    lambda children: (st.lists(children, max_size=4) | st.lists(children, max_size=4).map(tuple)
                      | st.dictionaries(st.text() | st.integers(), children, max_size=4)
                      | st.sets(_PLAIN_SCALARS, max_size=4) | st.frozensets(_PLAIN_SCALARS, max_size=4)),
    max_leaves=12)


@given(_PLAIN_VALUES)
def test_any_nesting_of_plain_values_crosses_intact(value):
    decoded = _loads(_dumps(value))
    assert decoded == value and type(decoded) is type(value)
