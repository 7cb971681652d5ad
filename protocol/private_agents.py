"""Ops a UI and an agent runtime need around private agents: the lazy `@`
candidate resolver, contribution capability, per-message context state and
visibility diagnostics (collaborator-policy.md §5.1, §7.2; scope-model.md §3.9)."""

from __future__ import annotations

import msgspec

from protocol.frames import Request

FRAMES: tuple[type[Request], ...] = ()
RESULTS: dict[type[Request], type[msgspec.Struct]] = {}
