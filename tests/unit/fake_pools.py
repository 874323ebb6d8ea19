"""In-process stand-ins for worker pools, so ``EngineCore`` steps without processes.

A ``FakePool`` keeps each request's tokens as a worker would, runs the steps it was
given in order (``max_in_flight`` at most: 2 for async scheduling), completes each after
``step_polls`` polls (sampling a deterministic token for every request that reached its
end), reports the KV it was told to copy out, and lands a KV transfer ``land_polls``
polls after it learned of it — or fails it, when the test says so.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.messages import (
    KVTransferResult,
    ModelInfo,
    ModelRunnerOutput,
    PoolRole,
    SchedulerOutput,
    WorkerReady,
)
from engine_core.executor import PoolEvents

MODEL = ModelInfo(max_model_len=4096, vocab_size=1000, eos_token_ids=[0])
BLOCK = 4


def token_for(request_id: str, position: int) -> int:
    """A deterministic, never-EOS token: tests can predict every output."""
    return 10 + (sum(map(ord, request_id)) + 7 * position) % 900


@dataclass
class FakePool:
    role: PoolRole
    num_blocks: int
    step_polls: int = 1
    land_polls: int = 1
    kv_address: str = "tcp://fake-decode:1"
    kv_addresses: list[str] = field(default_factory=lambda: ["tcp://fake-decode:1"])
    steps: list[SchedulerOutput] = field(default_factory=list)
    fail_transfers: set[str] = field(default_factory=set)  # transfer ids to fail on landing
    max_in_flight: int = 1
    most_in_flight: int = 0  # the most steps it ever held at once
    _in_flight: deque[SchedulerOutput] = field(default_factory=deque)
    _polls: int = 0
    _tokens: dict[str, list[int]] = field(default_factory=dict)
    _computed: dict[str, int] = field(default_factory=dict)
    _landing: dict[str, int] = field(default_factory=dict)  # transfer id -> polls left
    dead: str | None = None
    num_threads: int = 0  # what its workers' latest steps ran on

    @property
    def busy(self) -> bool:
        return bool(self._in_flight)

    def wait_ready(self) -> WorkerReady:
        return WorkerReady(0, self.num_blocks, BLOCK, MODEL, self.role, self.kv_address, 1024)

    def submit(self, step: SchedulerOutput) -> None:
        assert len(self._in_flight) < self.max_in_flight, "too many steps in flight"
        self.steps.append(step)
        if not self._in_flight:
            self._polls = 0
        self._in_flight.append(step)
        self.most_in_flight = max(self.most_in_flight, len(self._in_flight))
        for transfer_id in step.kv_cancels:
            self._landing.pop(transfer_id, None)
        for receive in step.kv_receives:
            self._landing[receive.transfer_id] = self.land_polls

    def check_alive(self) -> None:
        if self.dead is not None:
            from engine_core.executor import WorkerDied

            raise WorkerDied(self.dead)

    def poll(self) -> PoolEvents:
        events = PoolEvents()
        for transfer_id in list(self._landing):
            self._landing[transfer_id] -= 1
            if self._landing[transfer_id] <= 0:
                del self._landing[transfer_id]
                ok = transfer_id not in self.fail_transfers
                events.transfers.append(
                    KVTransferResult(transfer_id, ok, None if ok else "checksum mismatch", 4096)
                )
        if not self._in_flight:
            return events
        self._polls += 1
        if self._polls < self.step_polls:
            return events
        step = self._in_flight.popleft()
        self._polls = 0
        for request_id in step.finished_request_ids:
            self._tokens.pop(request_id, None)
        for new in step.new_requests:
            self._tokens[new.request_id] = list(new.token_ids)
        ids, sampled = [], []
        for request_id, n in step.num_scheduled_tokens.items():
            tokens = self._tokens[request_id]
            start = next(
                (r.num_computed_tokens for r in step.new_requests if r.request_id == request_id),
                None,
            )
            if start is None:
                start = next(
                    c.num_computed_tokens
                    for c in step.cached_requests
                    if c.request_id == request_id
                )
            if start + n == len(tokens):
                token = token_for(request_id, len(tokens))
                tokens.append(token)
                ids.append(request_id)
                sampled.append(token)
        events.result = ModelRunnerOutput(
            step.step_id, ids, sampled, kv_copied=[s.transfer_id for s in step.kv_sends]
        )
        return events
