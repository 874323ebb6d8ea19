"""Which LoRA adapters a pool's steps may run: at most ``--max-loras`` distinct ones.

The scheduler asks ``admit`` before a request with an adapter joins the running batch.
An adapter already resident is free; a new one takes a free slot, or the slot of the
least recently used adapter that no running request still uses (a swap); with every
slot busy the request waits (the scheduler lets the requests behind it go first). So no
step ever runs more distinct adapters than are resident, and the workers' caches
(``--max-cpu-loras`` >= ``--max-loras``) always hold them. Requests without an adapter
never wait here.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from common.messages import LoRARequest


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._resident: OrderedDict[int, str] = OrderedDict()  # int_id -> name, LRU first
        self.num_swaps_total = 0  # adapters brought into a slot (the first time too)

    def admit(self, lora: LoRARequest | None, running: Iterable[LoRARequest | None]) -> bool:
        """Whether a request with ``lora`` may join ``running`` (the adapters of the
        requests running now, one entry each); marks its adapter used if so."""
        if lora is None:
            return True
        if lora.int_id in self._resident:
            self._resident.move_to_end(lora.int_id)
            return True
        if len(self._resident) >= self.max_loras:
            in_use = {r.int_id for r in running if r is not None}
            idle = next((i for i in self._resident if i not in in_use), None)
            if idle is None:
                return False
            del self._resident[idle]
        self._resident[lora.int_id] = lora.name
        self.num_swaps_total += 1
        return True

    @property
    def resident(self) -> list[str]:
        """The resident adapters' names, least recently used first."""
        return list(self._resident.values())


def adapter_counts(loras: Iterable[LoRARequest | None]) -> dict[str, int]:
    """Requests per adapter name (those without one left out): the metrics' figures."""
    return dict(Counter(lora.name for lora in loras if lora is not None))
