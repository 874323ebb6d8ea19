"""``freeze_startup_heap``: what a process holds when it starts serving (modules, the
tokenizer, the model's Python side, the KV manager's blocks) is moved out of the objects
the collector walks, so that a full collection while serving walks only what serving
made (a full collection in the API server stalled every stream; docs/benchmarks.md)."""

from __future__ import annotations

import gc
import weakref

from common.process import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.peer: _Node | None = None


def test_objects_alive_at_start_leave_the_collected_generations() -> None:
    startup = [_Node() for _ in range(1000)]
    cycle_garbage = _Node()
    cycle_garbage.peer = cycle_garbage  # unreachable after `del`: only a collection frees it
    garbage_ref = weakref.ref(cycle_garbage)
    del cycle_garbage
    try:
        freeze_startup_heap()
        walked = {id(o) for o in gc.get_objects()}
        assert not any(id(node) in walked for node in startup)
        assert gc.get_freeze_count() >= len(startup)
        # It collected first: the garbage cycle was freed, not frozen for good.
        assert garbage_ref() is None
        served = _Node()
        assert id(served) in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
