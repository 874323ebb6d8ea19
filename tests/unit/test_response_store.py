"""ResponseStore: per-owner visibility, the bound on entries, the TTL (a fake clock)."""

from __future__ import annotations

from api_server.chat_protocol import text_message
from api_server.response_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def put(store: ResponseStore, owner: str | None, response_id: str) -> None:
    store.put(owner, response_id, {"id": response_id}, [text_message("user", response_id)])


def test_a_response_is_seen_and_deleted_by_its_owner_only() -> None:
    store = ResponseStore()
    put(store, "key-a", "resp_1")
    kept = store.get("key-a", "resp_1")
    assert kept is not None and kept.body == {"id": "resp_1"}
    assert store.get("key-b", "resp_1") is None and store.get(None, "resp_1") is None
    assert store.delete("key-b", "resp_1") is False and len(store) == 1
    assert store.delete("key-a", "resp_1") is True and len(store) == 0
    assert store.get("key-a", "resp_1") is None and store.delete("key-a", "resp_1") is False


def test_the_oldest_goes_first_past_the_bound() -> None:
    store = ResponseStore(max_entries=2)
    for i in range(3):
        put(store, None, f"resp_{i}")
    assert len(store) == 2
    assert [store.get(None, f"resp_{i}") is not None for i in range(3)] == [False, True, True]


def test_responses_expire_after_the_ttl() -> None:
    clock = Clock()
    store = ResponseStore(ttl_s=10.0, clock=clock)
    put(store, None, "resp_old")
    clock.now = 6.0
    put(store, None, "resp_new")
    clock.now = 10.0  # resp_old's ten seconds are up; resp_new has six left
    assert store.get(None, "resp_old") is None and store.get(None, "resp_new") is not None
    clock.now = 16.0
    assert store.get(None, "resp_new") is None and len(store) == 0
