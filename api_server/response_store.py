"""Responses kept for ``GET /v1/responses/{id}`` and ``previous_response_id``.

In memory, in this API-server process: bounded (the oldest response goes first once
``max_entries`` are kept), each for ``ttl_s`` after it was made, and visible only to the
API key that made it (without API keys, every caller is one owner). A response made with
``store: false`` is never kept. With ``--api-server-count`` above 1, a response is kept by
the process that answered it: a later request landing on another process does not see it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from api_server.chat_protocol import ChatMessage

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    owner: str | None
    body: dict[str, Any]  # the response object as it was answered
    conversation: list[ChatMessage]  # its input through its output: what a next turn continues
    expires_at: float


class ResponseStore:
    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        owner: str | None,
        response_id: str,
        body: dict[str, Any],
        conversation: list[ChatMessage],
    ) -> None:
        self._expire()
        self._entries[response_id] = StoredResponse(
            owner, body, conversation, self._clock() + self.ttl_s
        )
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        """The response if it is kept and ``owner`` made it; else None (another key's
        response is as absent as one never made)."""
        self._expire()
        stored = self._entries.get(response_id)
        return stored if stored is not None and stored.owner == owner else None

    def delete(self, owner: str | None, response_id: str) -> bool:
        if self.get(owner, response_id) is None:
            return False
        del self._entries[response_id]
        return True

    def _expire(self) -> None:
        now = self._clock()
        # Entries are in order of making and share one TTL: the expired ones lead.
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.expires_at > now:
                break
            self._entries.popitem(last=False)
