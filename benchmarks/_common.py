"""What the multi-process benchmarks share."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (for a gloo store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
