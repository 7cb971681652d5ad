"""Ops of owner-private collaboration: private grants, Scope Executions and
People collaborators (scope-model.md §3.5, collaborator-policy.md §3, §6, §8)."""

from __future__ import annotations

import msgspec

from protocol.frames import Request

FRAMES: tuple[type[Request], ...] = ()
RESULTS: dict[type[Request], type[msgspec.Struct]] = {}
