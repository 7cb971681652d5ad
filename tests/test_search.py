"""Message search (issue 17; scope-model.md §3.15, §3.16; protocol/search.py) over the
WebSocket against PostgreSQL: whole-word English matching with `websearch_to_tsquery`
syntax, substring matching of Chinese / Japanese / Korean text, the filters, attachment
labels, withdrawal and edits at their commit, a stable cursor, the candidate budget,
typed errors, workspace isolation, every reader kind (members, non-members, a
private agent with and without its owner's grant, DM, thread and service-account
readers) through history's readable predicate, and the readiness gate with the `scopewire search backfill / finalize`
admin commands run as an operator runs them."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import sys

import pytest
import trio

from client import ClientError, connect
from storage.schema import SCHEMA
from tests.conftest import App, add_person
from tests.test_admin_cli import PROJECT_ROOT
from tests.test_messaging import open_channel
from tests.test_service_account_audience import create_account, post
from tests.test_tenancy import expect_error, signed_in

MAX_PAGES = 200  # a search that pages longer than this never ends


@pytest.fixture
async def team(app: App, tenants, member_password_hash):
    """Alpha's owner, Bob and Carol; Beta for cross-workspace probes."""
    alpha, beta = tenants
    bob = await add_person(app.db, alpha.workspace_id, "bob@example.com", "developer", member_password_hash)
    carol = await add_person(app.db, alpha.workspace_id, "carol@example.com", "developer", member_password_hash)
    return alpha, beta, bob, carol, {"workspace_id": alpha.workspace_id}


@contextlib.asynccontextmanager
async def as_agent(app: App, key: str):
    async with connect(app.url) as conn:
        await conn.auth(api_key=key)
        yield conn


async def search_pages(conn, ws: dict, **fields) -> list[dict]:
    """Every page of one search, following `next_cursor` while `has_more`."""
    pages = [await conn.call("message.search", **fields, **ws)]
    while pages[-1]["has_more"]:
        assert len(pages) < MAX_PAGES, "the cursor never reaches the end"
        assert pages[-1].get("next_cursor"), "has_more without a next_cursor"
        pages.append(await conn.call("message.search", **fields, cursor=pages[-1]["next_cursor"], **ws))
    return pages


async def hit_ids(conn, ws: dict, query: str = "", **fields) -> list[str]:
    """The ids of every hit of a search, in the order the pages give them."""
    if query:
        fields["query"] = query
    ids = [hit["message"]["id"] for page in await search_pages(conn, ws, **fields) for hit in page["hits"]]
    assert len(ids) == len(set(ids)), f"a hit repeated across pages: {ids}"
    return ids


async def send(conn, ws: dict, scope_id: str, content: str, **fields) -> dict:
    return await conn.call("message.send", scope_id=scope_id, content=content, **fields, **ws)


async def upload(conn, ws: dict, scope_id: str, data: bytes, *, filename: str, content_type: str = "text/plain",
                 label: str | None = None) -> dict:
    """A stored upload through attachment.upload.begin / chunk / finish (JSON carries bytes as base64)."""
    extra = {"label": label} if label is not None else {}
    begun = await conn.call("attachment.upload.begin", scope_id=scope_id, filename=filename,
                            content_type=content_type, byte_size=len(data),
                            sha256=hashlib.sha256(data).hexdigest(), **extra, **ws)
    await conn.call("attachment.upload.chunk", attachment_id=begun["id"], offset=0,
                    data=base64.b64encode(data).decode(), **ws)
    stored = await conn.call("attachment.upload.finish", attachment_id=begun["id"], **ws)
    assert stored["state"] == "stored"
    return stored


# --- the query ------------------------------------------------------------------------------------

async def test_english_words_match_whole_and_ignoring_case_with_websearch_syntax(app: App, team):
    alpha, _, _, _, ws = team
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "words")
        fox = await send(owner, ws, channel["id"], "The Quick brown fox jumps over the lazy dog")
        quickly = await send(owner, ws, channel["id"], "quickly done, no animals")
        cat = await send(owner, ws, channel["id"], "a QUICK cat, brown as well")
        fox_alone = await send(owner, ws, channel["id"], "fox")
        # Newest first; whole words only ("quickly" is not "quick"); case ignored both ways.
        assert await hit_ids(owner, ws, "quick") == [cat["id"], fox["id"]]
        assert await hit_ids(owner, ws, "qUiCk") == [cat["id"], fox["id"]]
        assert await hit_ids(owner, ws, "quickly") == [quickly["id"]]
        assert await hit_ids(owner, ws, "qui") == []
        # All words must match; a quoted phrase must match in order.
        assert await hit_ids(owner, ws, "brown quick") == [cat["id"], fox["id"]]
        assert await hit_ids(owner, ws, '"brown fox"') == [fox["id"]]
        assert await hit_ids(owner, ws, '"fox brown"') == []
        # -word excludes, `or` unites.
        assert await hit_ids(owner, ws, "quick -fox") == [cat["id"]]
        assert await hit_ids(owner, ws, "cat or fox") == [fox_alone["id"], cat["id"], fox["id"]]
        assert await hit_ids(owner, ws, "giraffe") == []
        # Punctuation around a word does not hide it.
        assert await hit_ids(owner, ws, "done") == [quickly["id"]]

        # The hit is the message as history shows it, with a snippet and highlights in it.
        page = await owner.call("message.search", query="lazy", **ws)
        (hit,) = page["hits"]
        history = await owner.call("message.history", scope_id=channel["id"], **ws)
        assert hit["message"] == history["messages"][0]
        assert (page["has_more"], page["candidate_budget_exhausted"], page["complete"]) == (False, False, True)
        assert "next_cursor" not in page
        assert "lazy" in hit["snippet"]
        assert [hit["snippet"][start:end].lower() for start, end in hit["highlights"]] == ["lazy"]


async def test_chinese_japanese_and_korean_text_is_found_by_substring(app: App, team):
    alpha, _, _, _, ws = team
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "cjk")
        chinese = await send(owner, ws, channel["id"], "我们正在测试全文搜索功能")
        mixed = await send(owner, ws, channel["id"], "Release 计划：下周发布搜索 beta")
        japanese = await send(owner, ws, channel["id"], "これはテストです。カタカナとひらがな")
        korean = await send(owner, ws, channel["id"], "안녕하세요 검색 기능")
        fullwidth = await send(owner, ws, channel["id"], "ＳＥＡＲＣＨ　ｗｏｒｋｓ")  # NFKC: "SEARCH works"

        assert await hit_ids(owner, ws, "搜索") == [mixed["id"], chinese["id"]]
        assert await hit_ids(owner, ws, "全文搜索功能") == [chinese["id"]]
        assert await hit_ids(owner, ws, "我们正在测试全文搜索功能") == [chinese["id"]]
        assert await hit_ids(owner, ws, "搜") == [mixed["id"], chinese["id"]]
        assert await hit_ids(owner, ws, "功") == [chinese["id"]]
        # Characters that are all there, but not as a substring, are no hit.
        assert await hit_ids(owner, ws, "索全") == []
        assert await hit_ids(owner, ws, "搜功") == []
        assert await hit_ids(owner, ws, "能功") == []
        # CJK and words together: both must match.
        assert await hit_ids(owner, ws, "搜索 beta") == [mixed["id"]]
        assert await hit_ids(owner, ws, "搜索 release") == [mixed["id"]]
        assert await hit_ids(owner, ws, "搜索 gamma") == []
        assert await hit_ids(owner, ws, "发布搜索") == [mixed["id"]]
        # Japanese kana (katakana and hiragana) and Korean Hangul, by substring too.
        assert await hit_ids(owner, ws, "テスト") == [japanese["id"]]
        assert await hit_ids(owner, ws, "スト") == [japanese["id"]]
        assert await hit_ids(owner, ws, "ひらが") == [japanese["id"]]
        assert await hit_ids(owner, ws, "トテ") == []
        assert await hit_ids(owner, ws, "하세") == [korean["id"]]
        assert await hit_ids(owner, ws, "검색") == [korean["id"]]
        assert await hit_ids(owner, ws, "세하") == []
        # Full-width Latin is the same word after NFKC normalization, both ways.
        assert await hit_ids(owner, ws, "search") == [fullwidth["id"]]
        assert await hit_ids(owner, ws, "ｗｏｒｋｓ") == [fullwidth["id"]]

        # Highlights cover the matched substring, in code points.
        (hit,) = (await owner.call("message.search", query="全文搜索", **ws))["hits"]
        assert [hit["snippet"][start:end] for start, end in hit["highlights"]] == ["全文搜索"]
        (hit,) = (await owner.call("message.search", query="テスト", **ws))["hits"]
        assert [hit["snippet"][start:end] for start, end in hit["highlights"]] == ["テスト"]


async def test_a_substring_never_spans_text_that_is_not_there(app: App, team):
    """Two runs of Chinese apart (punctuation, a space, a line, the content and a label)
    are not one string: a query bridging them is no substring of the message."""
    alpha, _, _, _, ws = team
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "runs")
        apart = await send(owner, ws, channel["id"], "我们搜索，索引很快")
        spaced = await send(owner, ws, channel["id"], "数据库 库存")
        lines = await send(owner, ws, channel["id"], "服务器\n器材")
        assert await hit_ids(owner, ws, "搜索") == [apart["id"]]
        assert await hit_ids(owner, ws, "索引很") == [apart["id"]]
        assert await hit_ids(owner, ws, "搜索引") == []
        assert await hit_ids(owner, ws, "我们搜索索引") == []
        assert await hit_ids(owner, ws, "据库存") == []
        assert await hit_ids(owner, ws, "数据库") == [spaced["id"]]
        assert await hit_ids(owner, ws, "务器材") == []
        assert await hit_ids(owner, ws, "器材") == [lines["id"]]


async def test_operators_apply_to_chinese_terms_and_runs_are_found_anywhere(app: App, team):
    """`-` and `or` mean the same for an unsegmented term as for a word, and a run deep in a
    long message (past where PostgreSQL keeps positions) is still found by substring."""
    alpha, _, _, _, ws = team
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "ops")
        both = (await send(owner, ws, channel["id"], "我们搜索"))["id"]
        other = (await send(owner, ws, channel["id"], "功能上线"))["id"]
        plain = (await send(owner, ws, channel["id"], "我们的 cats"))["id"]
        assert await hit_ids(owner, ws, "我们 -搜索") == [plain]
        assert await hit_ids(owner, ws, "搜索 or 功能") == [other, both]
        assert await hit_ids(owner, ws, "cats or 功能") == [plain, other]
        assert await hit_ids(owner, ws, "-cats 我们") == [both]
        long = (await send(owner, ws, channel["id"], "天地玄黄宇宙洪荒" * 2200 + "，搜索功能上线"))["id"]
        assert await hit_ids(owner, ws, "搜索功能", scope_id=channel["id"]) == [long]
        page = await owner.call("message.search", query="搜索功能", **ws)
        assert page["hits"][0]["snippet"][slice(*page["hits"][0]["highlights"][0])] == "搜索功能"


async def test_snippet_of_a_long_message_is_bounded_and_centred_on_the_match(app: App, team):
    alpha, _, _, _, ws = team
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "long")
        content = "填充" * 2000 + "目标词语" + "padding " * 500
        await send(owner, ws, channel["id"], content)
        (hit,) = (await owner.call("message.search", query="目标词语", **ws))["hits"]
        assert len(hit["snippet"]) <= 220  # "≤ ~200 code points"
        assert hit["snippet"] in content
        assert [hit["snippet"][start:end] for start, end in hit["highlights"]] == ["目标词语"]


# --- filters --------------------------------------------------------------------------------------

async def test_filters_by_scope_author_time_and_mentions(app: App, team):
    alpha, _, bob, carol, ws = team
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        general = await open_channel(owner, alpha.workspace_id, "general", [bob.member_id, carol.member_id])
        random = await open_channel(owner, alpha.workspace_id, "random", [bob.member_id])
        early = [await send(owner, ws, general["id"], "status report one"),
                 await send(b, ws, random["id"], "status report two")]
        await trio.sleep(0.05)  # a clear millisecond boundary between the batches
        late = [await send(b, ws, general["id"], "status report three"),
                await send(owner, ws, random["id"], "@bob status report four"),
                await send(owner, ws, general["id"], "@bob and @carol, nothing to see")]
        boundary = max(m["created_at_ms"] for m in early) + 1
        assert boundary <= min(m["created_at_ms"] for m in late)
        ids = [m["id"] for m in early + late]

        assert await hit_ids(b, ws, "report", scope_id=general["id"]) == [ids[2], ids[0]]
        assert await hit_ids(b, ws, "report", scope_id=random["id"]) == [ids[3], ids[1]]
        assert await hit_ids(b, ws, "report", author_member_id=bob.member_id) == [ids[2], ids[1]]
        assert await hit_ids(b, ws, "report", author_member_id=carol.member_id) == []
        assert await hit_ids(b, ws, "status", scope_id=general["id"], author_member_id=alpha.owner.member_id) == \
            [ids[0]]
        # after_ms inclusive, before_ms exclusive, on the creation time.
        assert await hit_ids(b, ws, "report", after_ms=boundary) == [ids[3], ids[2]]
        assert await hit_ids(b, ws, "report", before_ms=boundary) == [ids[1], ids[0]]
        assert await hit_ids(b, ws, "report", after_ms=boundary, before_ms=boundary) == []
        # mentions:me, as a field or in the query, alone or with words.
        assert await hit_ids(b, ws, mentions_me=True) == [ids[4], ids[3]]
        assert await hit_ids(b, ws, "mentions:me") == [ids[4], ids[3]]
        assert await hit_ids(b, ws, "report mentions:me") == [ids[3]]
        assert await hit_ids(b, ws, "report", mentions_me=True) == [ids[3]]
        assert await hit_ids(owner, ws, "mentions:me") == []
        async with await signed_in(app, carol) as c:
            assert await hit_ids(c, ws, "mentions:me") == [ids[4]]
            # Carol reads general only: filters never widen what she reads.
            assert await hit_ids(c, ws, "report") == [ids[2], ids[0]]
        # A filter-only query: everything of that author.
        assert await hit_ids(b, ws, author_member_id=bob.member_id) == [ids[2], ids[1]]


async def test_attachment_labels_are_searchable_and_has_attachment_filters(app: App, team):
    alpha, _, bob, _, ws = team
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        channel = await open_channel(owner, alpha.workspace_id, "files", [bob.member_id])
        labelled = await upload(owner, ws, channel["id"], b"quarterly numbers\n", filename="q3.txt",
                                label="Roadmap 路线图 draft")
        plain = await upload(owner, ws, channel["id"], b"just notes\n", filename="budget.txt")
        with_label = await send(owner, ws, channel["id"], "see attached", attachment_ids=[labelled["id"]])
        with_file = await send(owner, ws, channel["id"], "another file", attachment_ids=[plain["id"]])
        text_only = await send(owner, ws, channel["id"], "roadmap discussion, no file")
        assert [a["id"] for a in with_label["metadata"]["attachments"]] == [labelled["id"]]

        assert await hit_ids(b, ws, "roadmap") == [text_only["id"], with_label["id"]]
        assert await hit_ids(b, ws, "路线") == [with_label["id"]]
        assert await hit_ids(b, ws, "draft attached") == [with_label["id"]]
        # The default label is the filename.
        assert await hit_ids(b, ws, "budget.txt") == [with_file["id"]]
        assert await hit_ids(b, ws, "has:attachment") == [with_file["id"], with_label["id"]]
        assert await hit_ids(b, ws, has_attachment=True) == [with_file["id"], with_label["id"]]
        assert await hit_ids(b, ws, "roadmap has:attachment") == [with_label["id"]]
        assert await hit_ids(b, ws, "roadmap", has_attachment=True) == [with_label["id"]]
        assert await hit_ids(b, ws, "roadmap", has_attachment=False) == [text_only["id"]]
        # The file's contents are not indexed: only its label.
        assert await hit_ids(b, ws, "quarterly") == []
        # Withdrawing the message takes its attachment's label out of search too.
        await owner.call("message.withdraw", message_id=with_label["id"], **ws)
        assert await hit_ids(b, ws, "路线") == []
        assert await hit_ids(b, ws, "has:attachment") == [with_file["id"]]


# --- at the commit ------------------------------------------------------------------------------------

async def test_withdrawal_and_edits_are_searchable_as_of_their_commit(app: App, team):
    alpha, _, bob, _, ws = team
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        channel = await open_channel(owner, alpha.workspace_id, "changes", [bob.member_id])
        secret = await send(owner, ws, channel["id"], "the launch code is 机密密码")
        kept = await send(owner, ws, channel["id"], "launch day")
        assert await hit_ids(b, ws, "launch") == [kept["id"], secret["id"]]
        await owner.call("message.withdraw", message_id=secret["id"], **ws)
        # Immediately after the withdraw reply, no reader finds it by any of its text.
        for conn in (owner, b):
            assert await hit_ids(conn, ws, "launch") == [kept["id"]]
            assert await hit_ids(conn, ws, "机密") == []
            assert await hit_ids(conn, ws, "code") == []
            assert await hit_ids(conn, ws, author_member_id=alpha.owner.member_id) == [kept["id"]]
        docs = await app.db.run(lambda c: c.fetchval(
            "SELECT count(*) FROM scope_message_search_docs WHERE message_id = $1", secret["id"]))
        assert docs == 0  # deleted, not merely filtered

        edited = await owner.call("message.edit", message_id=kept["id"], content="postponed: 发布延期",
                                  expected_revision=1, **ws)
        assert edited["revision"] == 2
        assert await hit_ids(b, ws, "launch") == []
        assert await hit_ids(b, ws, "postponed") == [kept["id"]]
        assert await hit_ids(b, ws, "延期") == [kept["id"]]
        (hit,) = (await b.call("message.search", query="延期", **ws))["hits"]
        assert (hit["message"]["content"], hit["message"]["revision"]) == ("postponed: 发布延期", 2)
        await owner.call("message.edit", message_id=kept["id"], content="back on: launch", expected_revision=2, **ws)
        assert await hit_ids(b, ws, "延期") == []
        assert await hit_ids(b, ws, "launch") == [kept["id"]]


async def test_cursor_pages_are_stable_while_messages_arrive(app: App, team):
    alpha, _, bob, _, ws = team
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        channel = await open_channel(owner, alpha.workspace_id, "paging", [bob.member_id])
        other = await open_channel(owner, alpha.workspace_id, "paging-other", [bob.member_id])
        original = [(await send(owner, ws, (channel, other)[i % 3 == 0]["id"], f"page item {i} 页面"))["id"]
                    for i in range(11)]
        for query in ("item", "页面"):
            seen: list[str] = []
            page = await b.call("message.search", query=query, limit=3, **ws)
            pages = 1
            while True:
                seen += [hit["message"]["id"] for hit in page["hits"]]
                assert len(page["hits"]) <= 3
                # New matching messages between pages.
                await send(owner, ws, channel["id"], "late item" if query == "item" else "迟到的页面")
                if not page["has_more"]:
                    break
                page = await b.call("message.search", query=query, limit=3, cursor=page["next_cursor"], **ws)
                pages += 1
                assert pages <= 10
            # Exactly the messages there when paging began, newest first: no repeat, no gap.
            assert seen == original[::-1]
            assert pages == 4


@pytest.mark.parametrize("server_config", [{"search_candidate_budget": 3}], indirect=True)
async def test_a_spent_candidate_budget_pages_on_to_the_readable_hits(app: App, team):
    """The budget counts only messages the caller may read: a private agent's search says
    nothing (no has_more, no cursor, no spent budget) about messages it may not read; a
    reader with more matches than the budget gets pages of `budget` with the cursor."""
    alpha, _, bob, carol, ws = team
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        agent = await owner.call("agent.create", handle="scout", display_name="Scout", **ws)
        key = (await owner.call("apikey.create", name="scout", member_id=agent["id"], **ws))["key"]
        channel = await open_channel(owner, alpha.workspace_id, "budget", [bob.member_id, agent["id"]])
        secret = await open_channel(owner, alpha.workspace_id, "budget-secret", [bob.member_id],
                                    visibility="private")
        readable = [(await send(owner, ws, channel["id"], f"needle {i}"))["id"] for i in range(2)]
        for i in range(4):
            await send(b, ws, channel["id"], f"needle from bob {i}")  # the agent may not read these
            await send(b, ws, secret["id"], f"needle in private {i}")  # nor these
        async with as_agent(app, key) as scout:
            pages = await search_pages(scout, ws, query="needle", limit=10)
            assert [hit["message"]["id"] for page in pages for hit in page["hits"]] == readable[::-1]
            assert len(pages) == 1 and not pages[0]["has_more"] and not pages[0]["candidate_budget_exhausted"]
            assert "next_cursor" not in pages[0]
            nothing = await scout.call("message.search", query="needle from bob", **ws)
            assert nothing == {"hits": [], "has_more": False, "candidate_budget_exhausted": False, "complete": True}
        # Bob reads all ten: pages of `budget` (3) with the budget spent, then the rest.
        bob_pages = await search_pages(b, ws, query="needle", limit=10)
        assert sum(len(page["hits"]) for page in bob_pages) == 10
        assert [len(page["hits"]) for page in bob_pages] == [3, 3, 3, 1]
        for page in bob_pages[:-1]:
            assert page["has_more"] and page["candidate_budget_exhausted"] and page["next_cursor"], page
        async with await signed_in(app, carol) as c:
            carol_pages = await search_pages(c, ws, query="needle")
            assert [hit for page in carol_pages for hit in page["hits"]] == []


# --- readers ------------------------------------------------------------------------------------------

async def test_every_reader_finds_exactly_what_history_shows_it(app: App, team):
    alpha, _, bob, carol, ws = team
    async with (await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b,
                await signed_in(app, carol) as c):
        agent = await owner.call("agent.create", handle="scout", display_name="Scout", **ws)
        key = (await owner.call("apikey.create", name="scout", member_id=agent["id"], **ws))["key"]
        public = await open_channel(owner, alpha.workspace_id, "open", [bob.member_id, agent["id"]])
        private = await open_channel(owner, alpha.workspace_id, "closed", [carol.member_id], visibility="private")
        dm = await owner.call("dm.open", member_id=bob.member_id, **ws)
        sent = {
            "owner_public": await send(owner, ws, public["id"], "marker 标记 owner in public"),
            "bob_public": await send(b, ws, public["id"], "marker 标记 bob in public"),
            "owner_private": await send(owner, ws, private["id"], "marker 标记 owner in private"),
            "carol_private": await send(c, ws, private["id"], "marker 标记 carol in private"),
            "owner_dm": await send(owner, ws, dm["id"], "marker 标记 owner in dm"),
            "bob_dm": await send(b, ws, dm["id"], "marker 标记 bob in dm"),
        }
        grant = await owner.call("private_grant.create", scope_id=public["id"], grantee_member_id=bob.member_id,
                                 **ws)
        sent["bob_granted"] = await send(b, ws, public["id"], "marker 标记 bob granted")
        await owner.call("private_grant.revoke", grant_id=grant["id"], **ws)
        sent["bob_after"] = await send(b, ws, public["id"], "marker 标记 bob after revoke")
        readers = {
            "owner": (owner, set(sent)),
            "bob": (b, {"owner_public", "bob_public", "owner_dm", "bob_dm", "bob_granted", "bob_after"}),
            "carol": (c, {"owner_private", "carol_private"}),  # public channel not joined: not readable
        }
        async with as_agent(app, key) as scout:
            readers["agent"] = (scout, {"owner_public", "bob_granted"})
            for name, (conn, expected) in readers.items():
                want = sorted((sent[k] for k in expected), key=lambda m: -m["global_seq"])
                for query in ("marker", "标记", "记"):
                    assert await hit_ids(conn, ws, query) == [m["id"] for m in want], (name, query)
                # The same set as history, scope by scope.
                for scope in (public, private, dm):
                    try:
                        history = await conn.call("message.history", scope_id=scope["id"], **ws)
                    except ClientError as exc:
                        error = await expect_error(exc.code, conn.call(
                            "message.search", query="marker", scope_id=scope["id"], **ws))
                        assert not [m for m in want if m["scope_id"] == scope["id"]], (name, error)
                        continue
                    readable = [m["id"] for m in history["messages"]][::-1]
                    assert await hit_ids(conn, ws, "marker", scope_id=scope["id"]) == readable, (name, scope)
                    assert readable == [m["id"] for m in want if m["scope_id"] == scope["id"]], (name, scope)


async def test_thread_replies_are_found_by_whoever_reads_the_thread(app: App, team):
    alpha, _, bob, carol, ws = team
    async with (await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b,
                await signed_in(app, carol) as c):
        agent = await owner.call("agent.create", handle="scout", display_name="Scout", **ws)
        key = (await owner.call("apikey.create", name="scout", member_id=agent["id"], **ws))["key"]
        channel = await open_channel(owner, alpha.workspace_id, "threads", [bob.member_id, carol.member_id,
                                                                            agent["id"]])
        root = await send(owner, ws, channel["id"], "root of the 讨论串")
        by_owner = await owner.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                                    content="owner reply in the 讨论串", **ws)
        by_bob = await b.call("thread.reply", scope_id=channel["id"], root_message_id=root["id"],
                              content="bob reply in the 讨论串", **ws)
        thread = by_owner["scope_id"]
        replies = {by_owner["id"], by_bob["id"]}
        async with as_agent(app, key) as scout:
            for name, conn in (("owner", owner), ("bob", b), ("carol", c), ("agent", scout)):
                found = await hit_ids(conn, ws, "讨论串")
                assert found[-1] == root["id"], name  # everyone reads the channel's root
                try:
                    shown = [m["id"] for m in (await conn.call("message.history", scope_id=thread, **ws))["messages"]]
                except ClientError as exc:  # not a reader of the thread: no reply is found
                    assert set(found) & replies == set(), name
                    await expect_error(exc.code, conn.call("message.search", query="reply", scope_id=thread, **ws))
                    continue
                assert found == shown[::-1] + [root["id"]], name
                assert await hit_ids(conn, ws, "reply", scope_id=thread) == shown[::-1], name
                if name == "agent":
                    assert shown == [by_owner["id"]]  # its owner's reply only
                else:
                    assert set(shown) == replies, name


async def test_a_service_account_post_is_found_by_its_audience_as_history_shows_it(app: App, team):
    alpha, _, bob, _, ws = team
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        detail = await create_account(owner, ws, "News")
        scope_id = detail["profile"]["scope_id"]
        sent = await post(owner, ws, detail["profile"]["service_account_id"], "Launch", "公告：搜索功能上线 today")
        (hit,) = (await b.call("message.search", query="搜索功能", **ws))["hits"]
        (shown,) = (await b.call("message.history", scope_id=scope_id, **ws))["messages"]
        assert hit["message"] == shown and shown["id"] == sent["id"] and "author_profile" in shown
        assert await hit_ids(b, ws, "today", scope_id=scope_id) == [sent["id"]]


async def test_search_never_crosses_workspaces(app: App, team):
    alpha, beta, _, _, ws = team
    b_ws = {"workspace_id": beta.workspace_id}
    async with await signed_in(app, beta.owner) as owner_b, await signed_in(app, alpha.owner) as owner_a:
        b_channel = await open_channel(owner_b, beta.workspace_id, "beta-news")
        b_message = await send(owner_b, b_ws, b_channel["id"], "shared word 共享词 in beta")
        a_channel = await open_channel(owner_a, alpha.workspace_id, "alpha-news")
        a_message = await send(owner_a, ws, a_channel["id"], "shared word 共享词 in alpha")
        for query in ("shared", "共享词", "共"):
            assert await hit_ids(owner_a, ws, query) == [a_message["id"]]
            assert await hit_ids(owner_b, b_ws, query) == [b_message["id"]]
        assert await hit_ids(owner_a, ws, author_member_id=beta.owner.member_id) == []
        await expect_error("not_found", owner_a.call("message.search", query="shared", scope_id=b_channel["id"],
                                                     **ws))
        # Another workspace's id with a member of this one only.
        await expect_error("not_found", owner_a.call("message.search", query="shared", **b_ws))


async def test_bad_input_gets_typed_errors(app: App, team):
    alpha, _, _, _, ws = team
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "strict")
        await send(owner, ws, channel["id"], "one two three")
        for query in ("", "   ", "\u3000"):
            error = await expect_error("invalid", owner.call("message.search", query=query, **ws))
            assert error.details.get("reason") == "empty_query", error
        error = await expect_error("invalid", owner.call("message.search", **ws))
        assert error.details.get("reason") == "empty_query", error
        for cursor in ("garbage!", "AAAA", "bm90IGEgY3Vyc29y", "-1", "x" * 512, "游标"):
            await expect_error("invalid", owner.call("message.search", query="one", cursor=cursor, **ws))
        await expect_error("not_found", owner.call("message.search", query="one", scope_id="scp_zzzzzzzzzzzzzz",
                                                   **ws))
        await expect_error("invalid", owner.call("message.search", query="one", scope_id="scp_bad", **ws))
        await expect_error("invalid", owner.call("message.search", query="one", author_member_id="nope", **ws))
        for fields in ({"limit": 0}, {"limit": 51}, {"query": "x" * 501}, {"after_ms": -1}, {"query": 5},
                       {"mentions_me": "yes"}, {"unknown_field": 1}, {"cursor": ""}):
            await expect_error("bad_frame", owner.call("message.search", **{"query": "one", **fields}, **ws))
        for query in ("a\x00b", "\x00"):  # PostgreSQL text holds no NUL
            await expect_error("invalid", owner.call("message.search", query=query, **ws))
        # Any time the protocol accepts is a time, even past what a datetime holds (year 9999).
        for fields, hits in (({"after_ms": 2**53}, 0), ({"before_ms": 2**53}, 1), ({"after_ms": 253402300800000}, 0),
                             ({"before_ms": 0}, 0), ({"after_ms": 0}, 1)):
            try:
                page = await owner.call("message.search", query="one", **fields, **ws)
            except ClientError as exc:
                assert exc.code == "invalid", (fields, exc)
            else:
                assert len(page["hits"]) == hits, fields
        # Odd but well-formed queries are answered, never `internal`.
        for query in ('"', "-", "or", "- - -", '"unclosed phrase', "a:b:c", "has:", "mentions:you", "&|!():*",
                      "\\", "'", "%_", "🙂", "\u200b", "ﾃｽﾄ", "x" * 500, "搜" * 500, "搜 " * 250):
            try:
                await owner.call("message.search", query=query, **ws)
            except ClientError as exc:  # only a typed refusal of an empty query is allowed
                assert exc.code == "invalid", (query, exc)
                assert exc.details.get("reason") == "empty_query", (query, exc)


# --- readiness after an upgrade -----------------------------------------------------------------------

async def scopewire_search(dsn: str, *args: str) -> dict | list:
    """`scopewire search ...` as an operator runs it, in a process of its own."""
    done = await trio.run_process([sys.executable, "-m", "server.cli", "search", *args, "--database-url", dsn],
                                  capture_stdout=True, capture_stderr=True, check=False, cwd=PROJECT_ROOT)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


async def test_a_scope_indexed_after_an_upgrade_is_unavailable_until_backfill_and_finalize(
        app: App, team, database_dsn: str):
    alpha, _, bob, _, ws = team
    async with await signed_in(app, alpha.owner) as owner, await signed_in(app, bob) as b:
        legacy = await open_channel(owner, alpha.workspace_id, "legacy", [bob.member_id])
        fresh = await open_channel(owner, alpha.workspace_id, "fresh", [bob.member_id])
        old = [await send(owner, ws, legacy["id"], f"archive entry {i} 旧消息") for i in range(5)]
        await owner.call("message.withdraw", message_id=old[1]["id"], **ws)
        # The database as the upgrade to version 7 leaves it: messages written before it have
        # no documents, and the migration's own SQL marks their scopes not ready.
        await app.db.run(lambda c: c.execute("DELETE FROM scope_message_search_docs"))
        (version_7,) = [version for version in SCHEMA.versions if version.number == 7]
        for statement in version_7.after:
            await app.db.run(lambda c, statement=statement: c.execute(statement))
        new_elsewhere = await send(owner, ws, fresh["id"], "archive entry in a fresh scope")  # indexed at once

        error = await expect_error("unavailable", b.call("message.search", query="archive", scope_id=legacy["id"],
                                                         **ws))
        assert error.details.get("reason") == "search_not_ready"
        page = await b.call("message.search", query="archive", **ws)
        assert page["complete"] is False
        assert [hit["message"]["id"] for hit in page["hits"]] == [new_elsewhere["id"]]
        # Only scopes the searcher uses count: someone outside `legacy` learns nothing of it.
        async with await signed_in(app, team[3]) as carol:
            assert (await carol.call("message.search", query="archive", **ws))["complete"] is True
        # While the scope is not ready, the live path goes on: a send is indexed at once, an edit
        # rewrites its message's doc, a withdrawal deletes it; none of it is served yet.
        during = await send(owner, ws, legacy["id"], "archive entry while backfilling")
        edited = await owner.call("message.edit", message_id=old[3]["id"], content="archive entry 新内容",
                                  expected_revision=1, **ws)
        await owner.call("message.withdraw", message_id=old[2]["id"], **ws)
        assert await hit_ids(b, ws, "archive") == [new_elsewhere["id"]]

        def scope_ids(rows: list[dict]) -> list[str]:
            return [row["scope_id"] for row in rows]

        workspace = ("--workspace", alpha.workspace_id)
        status = await scopewire_search(database_dsn, "status", *workspace)
        assert [(row["scope_id"], row["read_ready"]) for row in status] == [(legacy["id"], False)]
        # Finalize before the backfill changes nothing.
        finalized = await scopewire_search(database_dsn, "finalize", *workspace)
        assert (finalized["finalized_scopes"], scope_ids(finalized["not_ready"])) == (0, [legacy["id"]])
        await expect_error("unavailable", b.call("message.search", query="archive", scope_id=legacy["id"], **ws))

        backfilled = await scopewire_search(database_dsn, "backfill", *workspace, "--batch", "2")
        assert backfilled["backfilled_scopes"] == 1
        await expect_error("unavailable", b.call("message.search", query="archive", scope_id=legacy["id"], **ws))
        finalized = await scopewire_search(database_dsn, "finalize", *workspace)
        assert (finalized["finalized_scopes"], finalized["not_ready"]) == (1, [])

        live = [during, old[4], edited, old[0]]  # newest first; old[1] and old[2] withdrawn
        assert await hit_ids(b, ws, "archive", scope_id=legacy["id"]) == [m["id"] for m in live]
        assert await hit_ids(b, ws, "旧消息", scope_id=legacy["id"]) == [old[4]["id"], old[0]["id"]]
        assert await hit_ids(b, ws, "新内容") == [edited["id"]]
        assert await hit_ids(b, ws, "3") == []  # the edit's old text ("archive entry 3 旧消息")
        page = await b.call("message.search", query="archive", **ws)
        assert page["complete"] is True
        assert await hit_ids(b, ws, "archive") == [during["id"], new_elsewhere["id"], old[4]["id"], edited["id"],
                                                   old[0]["id"]]

        async def snapshot():
            return await app.db.run(lambda c: c.fetch(
                "SELECT message_id, search_vector::text FROM scope_message_search_docs WHERE scope_id = $1 "
                "ORDER BY message_id", legacy["id"]))

        before = await snapshot()
        assert len(before) == len(live)
        # Both commands again: nothing changes, and ready stays ready.
        for _ in range(2):
            assert (await scopewire_search(database_dsn, "backfill", *workspace))["backfilled_scopes"] == 0
            assert (await scopewire_search(database_dsn, "finalize", *workspace)) == \
                {"finalized_scopes": 0, "not_ready": []}
        assert await snapshot() == before
        status = await scopewire_search(database_dsn, "status", *workspace)
        assert [(row["scope_id"], row["read_ready"]) for row in status] == [(legacy["id"], True)]
        assert await hit_ids(b, ws, "archive", scope_id=legacy["id"]) == [m["id"] for m in live]
