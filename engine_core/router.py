"""Conditional disaggregation: which pool prefills a new request when the pools are split.

Moving a prompt's KV costs a hand-off (a step in each pool and, with ``tcp``, the bytes
on the wire); computing a short prompt in the decode pool costs a few tokens in one of
its steps. So a prompt whose uncached part (what the decode pool's prefix cache does not
hold) is shorter than ``--disagg-min-prompt-tokens`` is prefilled in the decode pool:

- ``tcp``: always, unless the decode pool already has prompts waiting;
- ``shm``: a hand-off copies nothing, so only while the prefill pool is busy (more
  uncomputed prompt tokens queued than one of its steps takes), to relieve it.

Every such choice is counted (``kv_transfers_total{outcome="local_prefill"}``).
"""

from __future__ import annotations

from common.pool_config import DisaggConfig, KVMode
from engine_core.handoff import HandoffStats
from engine_core.kv_cache import extend_block_hashes
from engine_core.request import Request
from engine_core.scheduler import Scheduler


class Router:
    def __init__(
        self, prefill: Scheduler, decode: Scheduler, config: DisaggConfig, stats: HandoffStats
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.threshold = config.disagg_min_prompt_tokens
        self.shared_kv = config.kv_mode is not KVMode.TCP
        self.stats = stats

    def place(self, request: Request) -> Scheduler:
        """The prefill pool, or the decode pool for a short uncached prompt (counted)."""
        if not self.prefill_locally(request):
            return self.prefill
        self.stats.ended("local_prefill")
        return self.decode

    def uncached_tokens(self, request: Request) -> int:
        """Prompt tokens the decode pool would have to compute for this request."""
        kv = self.decode.kv
        extend_block_hashes(
            request.block_hashes, request.token_ids, kv.block_size, request.cache_salt
        )
        hits = kv.find_cached_prefix(request.block_hashes, request.num_tokens)
        return request.num_tokens - len(hits) * kv.block_size

    def prefill_busy(self) -> bool:
        return self.prefill.num_pending_prompt_tokens() > self.prefill.step_budget

    def prefill_locally(self, request: Request) -> bool:
        """Whether the decode pool should prefill this request itself."""
        if self.threshold == 0 or self.uncached_tokens(request) >= self.threshold:
            return False
        if self.shared_kv:
            return self.prefill_busy()
        return len(self.decode.waiting) == 0
