"""What dlock does to streams must work on any conforming event loop, not only on the
stock one: uvloop's transports hand out a PseudoSocket that refuses shutdown(), and
refuse writes once closed with a RuntimeError where the stock loop drops them."""

from __future__ import annotations

import asyncio
import socket

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from dlock._async.backends.mysql import _shut_down
from dlock._async.backends.redis import torn_connections_lost


class _RefusesShutdown:
    """Like uvloop's PseudoSocket: fileno() and the rest, but no shutdown()."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def fileno(self) -> int:
        return self._sock.fileno()

    def shutdown(self, how: int) -> None:
        raise TypeError("transport sockets do not support shutdown() method")


def test_a_stream_socket_that_refuses_shutdown_is_still_shut_down() -> None:
    left, right = socket.socketpair()
    with left, right:
        _shut_down(_RefusesShutdown(left))
        right.settimeout(2)
        assert right.recv(1) == b"", "the peer did not see the connection end"
    _shut_down(None)  # an ended loop's transport (uvloop) has no socket left


def test_a_write_refused_by_a_closed_uvloop_transport_is_a_lost_connection() -> None:
    message = (
        "unable to perform operation on <TCPTransport closed=True reading=False 0x1>;"
        " the handler is closed"
    )
    with pytest.raises(RedisConnectionError), torn_connections_lost():
        raise RuntimeError(message)
    with pytest.raises(RuntimeError, match="something else"), torn_connections_lost():
        raise RuntimeError("something else")


def test_a_uvloop_stream_is_shut_down() -> None:
    """uvloop's PseudoSocket refused shutdown() with a TypeError, so a cut-off MariaDB
    waiter's session was not hung up early (the error swallowed), and an abandoned
    connection's transport was left open (the error escaped its clean-up)."""
    import uvloop

    async def main() -> bytes:
        accepted: list[asyncio.StreamWriter] = []
        server = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            _shut_down(writer.get_extra_info("socket"))  # TypeError before the fix
            return await asyncio.wait_for(reader.read(), 2)
        finally:
            for each in (writer, *accepted):
                each.close()
            server.close()
            await server.wait_closed()

    loop = uvloop.new_event_loop()
    try:
        assert loop.run_until_complete(main()) == b""
    finally:
        loop.close()
