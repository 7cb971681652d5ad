"""Long-lived identifiers: the `prefix_14-char-base36` contract (service-account §7.2).

Layout of the 14 characters: 8 characters of milliseconds since 2020-01-01 UTC
(enough until 2109) followed by 6 characters (31 bits) that start at a random
value for every new millisecond and count upwards inside one millisecond.  So
ids sort by creation time, are strictly increasing inside one process, and need
no coordination between processes (a collision needs two processes to draw the
same 31-bit value in the same millisecond; primary keys catch that case).
"""

from __future__ import annotations

import re
import secrets
import threading
import time

_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_EPOCH_MS = 1_577_836_800_000  # 2020-01-01T00:00:00Z
_TIME_CHARS = 8
_TAIL_CHARS = 6
_TAIL_SPACE = 36**_TAIL_CHARS

PREFIXES = frozenset(
    {
        "acc",  # account
        "wsp",  # workspace
        "wmb",  # workspace membership
        "mem",  # member
        "inv",  # invitation
        "key",  # API key
        "scp",  # scope
        "smb",  # scope membership
        "grt",  # private grant
        "sex",  # scope execution (owner-private execution container)
        "col",  # People collaborator (task_scope_participant_metadata)
        "cev",  # collaborator audit event
        "cnj",  # collaborator notification job
        "msg",  # message
        "act",  # activity event
        "obx",  # outbox row
        "dlv",  # routed delivery (the sparse delivery ledger)
        "con",  # connection
        "req",  # request
        "sdf",  # service definition (Service Actor substrate)
        "cap",  # service capability
        "sin",  # service installation
        "ssm",  # service member
        "sgr",  # service grant
        "stb",  # service target binding
        "sac",  # service account
        "sam",  # service-account manager assignment
        "sar",  # service-account create request
        "apv",  # approval instance
        "ani",  # approval notification intent
        "snc",  # service notification card (sidecar of a card message)
        "sae",  # service-account audit event
        "pop",  # platform operator
        "pok",  # platform operator key
        "psa",  # platform service account (also its global principal)
        "psi",  # platform account's workspace instance
        "pbc",  # platform broadcast
        "pbd",  # platform broadcast delivery
        "pas",  # platform asset (an operator's upload a broadcast carries)
        "pml",  # platform moderation log entry
        "pae",  # platform audit event
        "nod",  # a server process (node)
        "tbd",  # task board
        "asg",  # strand assignment (assigned_to relation)
        "sau",  # strand audit event
        "att",  # attachment
        "amg",  # audience-mention (broadcast) grant
    }
)

_ID_RE = re.compile(r"^([a-z]{3})_([0-9a-z]{14})$")


def _base36(value: int, width: int) -> str:
    chars = []
    for _ in range(width):
        value, digit = divmod(value, 36)
        chars.append(_ALPHABET[digit])
    if value:
        raise OverflowError("value does not fit")
    return "".join(reversed(chars))


class _Generator:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = -1
        self._tail = 0

    def next_body(self) -> str:
        with self._lock:
            now_ms = time.time_ns() // 1_000_000 - _EPOCH_MS
            if now_ms > self._last_ms:
                self._last_ms = now_ms
                # Start low in the tail space so a busy millisecond has room to count.
                self._tail = secrets.randbelow(_TAIL_SPACE // 2)
            else:
                self._tail += 1
                if self._tail >= _TAIL_SPACE:
                    # Exhausted this millisecond: borrow the next one (stays monotonic).
                    self._last_ms += 1
                    self._tail = secrets.randbelow(_TAIL_SPACE // 2)
            return _base36(self._last_ms, _TIME_CHARS) + _base36(self._tail, _TAIL_CHARS)


_generator = _Generator()


def new_id(prefix: str) -> str:
    if prefix not in PREFIXES:
        raise ValueError(f"unknown id prefix {prefix!r}")
    return f"{prefix}_{_generator.next_body()}"


def is_valid_id(value: object, prefix: str | None = None) -> bool:
    """True when `value` is a well-formed id (of `prefix`, when given)."""
    if not isinstance(value, str):
        return False
    match = _ID_RE.match(value)
    if match is None or match.group(1) not in PREFIXES:
        return False
    return prefix is None or match.group(1) == prefix


def sql_check(column: str, prefix: str) -> str:
    """The CHECK expression that pins a column to one id prefix."""
    return f"{column} ~ '^{prefix}_[0-9a-z]{{14}}$'"
