"""A free TCP port, for the learner's process group, the gateway and the tests' servers."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on `host` now (another process may still take it before it is bound)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
