"""scopewire client SDK."""

from client.trio_client import ClientError, Connection, connect

__all__ = ["ClientError", "Connection", "connect"]
