"""Loopback ports for the server launcher, the tests and perf/."""

from __future__ import annotations

import contextlib
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1, free now. Every socket stays bound until all are picked: ports
    picked one at a time, each socket closed before the next bind, can repeat (it happened: Triton then refused
    gRPC and metrics on one port)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
