"""Handlers of the private-agent resolver and diagnostics ops (protocol/private_agents.py)."""

from __future__ import annotations

HANDLERS: dict = {}
