"""Pluggable point-to-point tensor transports between worker ranks.

``make_transport(protocol, rank)`` returns an ``inproc`` (threads of one process),
``shm`` (processes of one host) or ``tcp`` (any hosts) :class:`TensorTransport`.
"""

from mstar.runtime.transport.base import PROTOCOLS, Message, TensorTransport, make_transport

__all__ = ["PROTOCOLS", "Message", "TensorTransport", "make_transport"]
