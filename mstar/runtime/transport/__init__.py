"""Pluggable point-to-point tensor transports between worker ranks.

``make_transport(protocol, rank)`` returns an ``inproc`` (threads of one process),
``shm`` (processes of one host) or ``tcp`` (any hosts) :class:`TensorTransport`, or a
``shm+tcp`` one (shared memory to the ranks of its node, TCP to the rest: ranks spread
over the nodes of a Ray cluster).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mstar.runtime.transport.base import PROTOCOLS, Message, TensorTransport

if TYPE_CHECKING:
    import zmq

    from mstar.runtime.transport.inproc import InProcessHub

__all__ = ["PROTOCOLS", "Message", "TensorTransport", "make_transport"]


def make_transport(
    protocol: str,
    rank: int,
    *,
    host: str = "127.0.0.1",
    ctx: zmq.Context | None = None,
    hub: InProcessHub | None = None,
    node: str | None = None,
) -> TensorTransport:
    """Create the transport for ``protocol`` (``"inproc"``, ``"shm"``, ``"tcp"`` or ``"shm+tcp"``).

    ``host`` is the interface TCP binds to (and advertises); ``node`` names the machine of
    the rank (``shm+tcp``: peers of the same node get shared memory); ``ctx`` is an optional
    shared ZeroMQ context (tcp/shm); ``hub`` is the in-process registry (inproc; the
    process-wide default hub when omitted).
    """
    name = protocol.strip().lower() if isinstance(protocol, str) else protocol
    if name == "inproc":
        from mstar.runtime.transport.inproc import InProcessTransport, default_hub

        return InProcessTransport(rank, hub if hub is not None else default_hub())
    if name == "shm":
        from mstar.runtime.transport.shm import ShmTransport

        return ShmTransport(rank, ctx=ctx)
    if name == "tcp":
        from mstar.runtime.transport.tcp import TcpTransport

        return TcpTransport(rank, host=host, ctx=ctx)
    if name == "shm+tcp":
        from mstar.runtime.transport.nodes import NodeAwareTransport

        if node is None:
            raise ValueError("the shm+tcp transport needs the name of its node")
        return NodeAwareTransport(rank, node=node, host=host, ctx=ctx)
    raise ValueError(f"unknown transport protocol {protocol!r}; expected one of {', '.join(PROTOCOLS)}")
