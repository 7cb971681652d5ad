"""Structured logs: one JSON object per line on stderr.

Every line written while a connection's task (or a task it started) runs
carries `connection`, and while a command is answered also `request_id` and
`op`: they live in context variables set per connection and per request, so no
call site has to pass them.
"""

from __future__ import annotations

import logging
import sys
import time
from contextvars import ContextVar

import msgspec

# Attributes every LogRecord has; anything else came from `extra=` and is logged as a field.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}
_encoder = msgspec.json.Encoder(enc_hook=str)

connection_id: ContextVar[str | None] = ContextVar("scopewire_connection_id", default=None)
request_id: ContextVar[str | None] = ContextVar("scopewire_request_id", default=None)
request_op: ContextVar[str | None] = ContextVar("scopewire_request_op", default=None)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, var in (("connection", connection_id), ("request_id", request_id), ("op", request_op)):
            value = var.get()
            if value is not None:
                entry[key] = value
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return _encoder.encode(entry).decode()


def configure(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Library chatter stays out unless asked for.
    for noisy in ("trio-websocket", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
