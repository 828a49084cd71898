"""``server.start_server``: the listening socket has Nagle off (asyncio turns it off only for
sockets whose proto says TCP; with it on, each keep-alive response waited out the client's
delayed ACK, ~40 ms a call), keep-alive requests are answered on one connection, and a
response's headers and body leave in one write."""

from __future__ import annotations

import socket

import httpx


def test_the_endpoint_socket_has_nagle_off_and_keeps_connections(serve):
    ep = serve()
    sockets = [s for srv in ep.server.server.servers for s in srv.sockets]   # uvicorn's
    assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
    with httpx.Client() as client:
        assert [client.get(f"{ep.url}/health").status_code for _ in range(3)] == [200] * 3


def test_a_response_leaves_in_one_write(serve):
    """Headers and body in one segment: the first recv of a keep-alive response holds it all
    (uvicorn alone writes the headers first; the client then wakes up twice per call)."""
    ep = serve()
    host, port = ep.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        for _ in range(3):
            sock.sendall(f"GET /health HTTP/1.1\r\nhost: {host}\r\n\r\n".encode())
            data = sock.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            assert head.startswith(b"HTTP/1.1 200") and len(body) == length > 0
