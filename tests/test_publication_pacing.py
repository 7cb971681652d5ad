"""When a scope actor publishes a committed batch: while the next batch commits, or
before it when publishing costs this scope more than committing (actors/scope_actor.py)."""

from __future__ import annotations

import time

import pytest

from actors.scope_actor import Send
from domain.plan import MessageIntent
from tests.conftest import App
from tests.test_messaging import ListSink
from tests.test_messaging_hardening import _bare_scope

# Per event handed to the slow subscriber: far above any commit of a few sends.
SLOW_EVENT_SECONDS = 0.25


class SlowSink(ListSink):
    """Stands for a fanout to thousands of sockets: each event costs the publishing thread."""

    def admit(self, event) -> None:
        time.sleep(SLOW_EVENT_SECONDS)  # the publication never yields: a blocking cost is what it has
        super().admit(event)


@pytest.mark.parametrize("slow_fanout", [True, False], ids=["costly publication", "cheap publication"])
async def test_a_batch_is_published_before_the_next_commit_only_when_publishing_costs_more(
        app: App, tenants, monkeypatch, slow_fanout: bool):
    alpha, _ = tenants
    scope_id, actor = await _bare_scope(app.db, alpha)
    delivered: list = []
    hub = app.server.hub
    subscription = hub.subscribe(alpha.owner.member_id, (SlowSink if slow_fanout else ListSink)(delivered))
    hub.follow_scope(subscription, scope_id)
    registry = app.server.registry
    # One commit and one publication: what the actor's averages start from.
    await registry.submit(scope_id, Send(actor, MessageIntent(scope_id=scope_id, content="warm")))
    mailbox = registry._actors[scope_id].mailbox
    first_wave = [Send(actor, MessageIntent(scope_id=scope_id, content=f"first {i}")) for i in range(3)]
    second_wave = [Send(actor, MessageIntent(scope_id=scope_id, content=f"second {i}")) for i in range(3)]
    overlapped: list[bool] = []  # per commit: whether the batch before was published during it
    run_overlapping = app.db.run_overlapping

    async def recording(meanwhile, fn, *args, **kwargs):
        if getattr(fn, "__name__", "") == "_write_batch":
            overlapped.append(meanwhile is not None)
            if args[0] == first_wave:
                for command in second_wave:  # they arrive while the first wave commits
                    mailbox.send_nowait(command)
        return await run_overlapping(meanwhile, fn, *args, **kwargs)

    monkeypatch.setattr(app.db, "run_overlapping", recording)
    for command in first_wave:
        mailbox.send_nowait(command)
    for command in first_wave + second_wave:
        await command.reply.wait()
    # The first wave found the mailbox empty behind it only for the warm send; when it committed
    # the second wave was waiting: published first when that costs more, else meanwhile.
    assert overlapped == [False, not slow_fanout]
    assert [event.data.content for event in delivered] == (
        ["warm"] + [c.intent.content for c in first_wave + second_wave])
