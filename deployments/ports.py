"""Free TCP ports on this host: for tensor-parallel rendezvous, and for servers started by tools and tests."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A port nothing listens on now (the caller binds it soon after: another process may take it meanwhile)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
