"""``server.start_server``: the listening socket has Nagle off (asyncio turns it off only for
sockets whose proto says TCP; with it on, each keep-alive response waited out the client's
delayed ACK, ~40 ms a call), and keep-alive requests are answered on one connection."""

from __future__ import annotations

import socket

import httpx


def test_the_endpoint_socket_has_nagle_off_and_keeps_connections(serve):
    ep = serve()
    sockets = [s for srv in ep.server.server.servers for s in srv.sockets]   # uvicorn's
    assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
    with httpx.Client() as client:
        assert [client.get(f"{ep.url}/health").status_code for _ in range(3)] == [200] * 3
