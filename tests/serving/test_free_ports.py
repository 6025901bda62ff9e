"""The loopback ports a server is started on: several at once must be distinct and free."""

from __future__ import annotations

import socket

from pagedllm.net import free_port, free_ports


def test_ports_picked_together_are_distinct_and_bindable():
    ports = free_ports(64)
    assert len(set(ports)) == 64
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if the port were taken


def test_one_port_is_bindable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
