"""The OpenAI Realtime API at /v1/realtime: a spoken conversation over a WebSocket with a
backend that serves the ``realtime`` task (see docs/realtime.md)."""

from mstar.server.realtime.route import realtime_route

__all__ = ["realtime_route"]
