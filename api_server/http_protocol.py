"""uvicorn's HTTP/1.1 protocol with a deadline for a request's headers.

uvicorn times out idle keep-alive connections but not a client that sends its headers a
byte a second (slowloris): such a connection would be held forever. Here every
request's headers must arrive within ``--request-read-timeout-s`` of their first byte
(or of the connection opening), else the server answers 408 and closes the connection.
The body's deadline is enforced by the ``Guard`` middleware, which sees the body.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from api_server.errors import error_body


def _timeout_response(timeout_s: float) -> bytes:
    body = json.dumps(
        error_body(
            f"the request was not received within {timeout_s:g} s",
            "invalid_request_error",
            code="request_timeout",
        )
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def with_header_timeout(timeout_s: float) -> type[H11Protocol]:
    """An ``H11Protocol`` class whose requests must send their headers in ``timeout_s``."""

    class HeaderTimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE and self._header_timer is None:
                self._arm()  # the first bytes of another request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # the headers are in

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(timeout_s, self._on_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.transport.write(_timeout_response(timeout_s))
                self.transport.close()

    return HeaderTimedH11Protocol
