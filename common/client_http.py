"""The terminal client's HTTP side (``tandem chat``, ``complete``, ``status``): a server's
JSON routes and its server-sent-event streams, with every way a request can fail turned
into one ``ClientError`` whose message is the server's own (an OpenAI error body's
``message``) or says which URL could not be reached.

httpx only: the client never imports torch or transformers, so it starts in a fraction
of a second."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "TANDEM_URL"
API_KEY_ENV = "TANDEM_API_KEY"  # the same variable `tandem serve` reads its key from
# A stream may wait in a queue or behind a long prompt: no read deadline (Ctrl-C ends it).
_STREAM_TIMEOUT = httpx.Timeout(30.0, read=None)
_TIMEOUT = httpx.Timeout(30.0)


class ClientError(Exception):
    """A request that did not give its answer; the message is for the user's stderr."""


def error_message(reply: httpx.Response) -> str:
    """The message of an error reply: the OpenAI (or Anthropic) body's, else its text."""
    try:
        body = reply.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
        if message:
            return f"{reply.status_code}: {message}"
    text = reply.text.strip() or reply.reason_phrase
    return f"{reply.status_code}: {text}"


class TandemClient:
    """One server, by URL and API key. Not thread-safe; ``reset`` after an interrupted
    stream, whose connection may be left half read."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = self._connect()

    def _connect(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self._headers, timeout=_TIMEOUT)

    def reset(self) -> None:
        self._http.close()
        self._http = self._connect()

    def close(self) -> None:
        self._http.close()

    def get(self, path: str) -> httpx.Response:
        """The reply to ``GET path``, whatever its status."""
        try:
            return self._http.get(path)
        except httpx.HTTPError as e:
            raise ClientError(f"cannot reach {self.url}: {e}") from None

    def get_json(self, path: str) -> dict[str, Any]:
        reply = self.get(path)
        if reply.status_code != 200:
            raise ClientError(error_message(reply))
        body: dict[str, Any] = reply.json()
        return body

    def first_model(self) -> str:
        """The first model of ``/v1/models``: what a command without ``--model`` serves."""
        models = self.get_json("/v1/models").get("data") or []
        if not models:
            raise ClientError(f"{self.url}/v1/models lists no model")
        return str(models[0]["id"])

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of a streamed ``POST path`` until ``[DONE]``. An error reply, or an
        error event mid-stream, raises ``ClientError``."""
        try:
            with self._http.stream(
                "POST", path, json={**body, "stream": True}, timeout=_STREAM_TIMEOUT
            ) as reply:
                if reply.status_code != 200:
                    reply.read()
                    raise ClientError(error_message(reply))
                for line in reply.iter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, `event:` names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if isinstance(event.get("error"), dict):
                        raise ClientError(str(event["error"].get("message") or event["error"]))
                    yield event
        except httpx.ConnectError as e:
            raise ClientError(f"cannot reach {self.url}: {e}") from None
        except httpx.HTTPError as e:
            raise ClientError(f"the stream from {self.url}{path} broke off: {e}") from None
