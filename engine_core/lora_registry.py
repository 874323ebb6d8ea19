"""The LoRA adapters an engine serves, by name: the one list every API server mirrors
from the heartbeat (``--api-server-count`` processes agree on it).

Each load gets a new ``int_id`` for the engine's life, so an adapter unloaded and loaded
again from other files is a new adapter to the workers' caches. Unloading only stops new
requests: those running keep their ``LoRARequest`` and finish on it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from common.lora_config import LoRAModule
from common.messages import LoRARequest

logger = logging.getLogger(__name__)


class LoRARegistry:
    def __init__(self, modules: Iterable[LoRAModule] = ()) -> None:
        self._adapters: dict[str, LoRARequest] = {}
        self._next_id = 1
        for module in modules:
            self.load(module.name, module.path)

    def load(self, name: str, path: str) -> LoRARequest | None:
        """Serve ``path`` as ``name``; None if that name is taken (another API server
        loaded it first: the first load wins)."""
        if name in self._adapters:
            logger.warning("LoRA adapter %r is loaded already: kept as it is", name)
            return None
        adapter = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        self._adapters[name] = adapter
        logger.info("LoRA adapter %r (id %d) served from %s", name, adapter.int_id, path)
        return adapter

    def unload(self, name: str) -> bool:
        removed = self._adapters.pop(name, None)
        if removed is not None:
            logger.info("LoRA adapter %r (id %d) unloaded", name, removed.int_id)
        return removed is not None

    @property
    def adapters(self) -> list[LoRARequest]:
        return list(self._adapters.values())
