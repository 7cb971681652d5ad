"""Handlers of owner-private collaboration ops (protocol/collaboration.py)."""

from __future__ import annotations

HANDLERS: dict = {}
