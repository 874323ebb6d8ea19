"""The API server's async client of the engine core.

One reader task receives everything the engine sends this process and fans request
outputs out to per-request queues; heartbeats keep ``ready``, ``stats`` and ``model``
fresh. All sends go through one sender task, so ``abort_nowait`` is safe to call from
any ``finally`` (a cancelled stream included). The engine counts as dead after an
``EngineDead`` message or when no heartbeat came for ``DEAD_AFTER_S`` of this process's
own running time (``common.silence``: a pause of the whole machine is not a death).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncGenerator, Callable

import msgspec
import zmq
import zmq.asyncio

from common.config import EngineAddresses
from common.curve import CurveKeys
from common.ipc import Codec, make_socket
from common.messages import (
    AbortRequests,
    CancelRequests,
    ClientHello,
    EngineDead,
    EngineHeartbeat,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    ErrorKind,
    FinishReason,
    KVTransferStats,
    LoadLoRAAdapter,
    LoRARequest,
    ModelInfo,
    PoolRole,
    RequestOutput,
    ResetPrefixCache,
    SchedulerStats,
    UnloadLoRAAdapter,
)
from common.silence import Silence

logger = logging.getLogger(__name__)

DEAD_AFTER_S = 1.0
WATCHDOG_INTERVAL_S = 0.2


class EngineClient:
    def __init__(
        self, addresses: EngineAddresses, on_dead: Callable[[str], None] | None = None
    ) -> None:
        self._keys = CurveKeys(addresses.curve_keys) if addresses.curve_keys else None
        self.client_id = f"api-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
        self._addresses = addresses
        self._on_dead = on_dead
        self._codec: Codec[EngineOutput] = Codec(EngineOutput)
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._owners: dict[str, str | None] = {}  # request id -> the API key that made it
        self._send_queue: asyncio.Queue[msgspec.Struct] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self.ready = False
        self.stats = SchedulerStats()
        self.model: ModelInfo | None = None
        self.role = str(PoolRole.UNIFIED)  # until the first heartbeat says
        self.pools: dict[str, SchedulerStats] = {}  # split pools: each pool's figures
        self.kv_transfers: KVTransferStats | None = None
        self.lora_adapters: dict[str, LoRARequest] = {}  # by name, as the engine serves them
        self.dead_reason: str | None = None
        self._silence = Silence(max_gap_s=WATCHDOG_INTERVAL_S)
        self.num_malformed_frames = 0

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        secure = self._keys.make_client if self._keys else None
        self._push = make_socket(
            self._ctx, zmq.PUSH, self._addresses.input_address, bind=False, secure=secure
        )
        self._dealer = make_socket(
            self._ctx,
            zmq.DEALER,
            self._addresses.output_address,
            bind=False,
            identity=self.client_id,
            secure=secure,
        )
        await self._dealer.send(self._codec.encode(ClientHello(self.client_id)))  # type: ignore[misc]
        self._tasks = [
            asyncio.create_task(self._read_loop()),
            asyncio.create_task(self._send_loop()),
            asyncio.create_task(self._watchdog()),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._push.close()
        self._dealer.close()
        self._ctx.term()

    @property
    def heard_from_engine(self) -> bool:
        """Whether any heartbeat has arrived (the engine answers, ready or not)."""
        return self._silence.ever_heard

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    # ------------------------------------------------------------------ requests

    async def generate(
        self, request: EngineRequest, owner: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Send the request and yield its outputs until one carries a finish reason.
        Leaving early (client gone, stop string hit) aborts it in the engine. ``owner``
        (an API key's identity) is the only caller ``cancel`` will obey for it."""
        if self.dead_reason is not None:
            yield RequestOutput(
                request.request_id, [], FinishReason.ERROR, self.dead_reason, ErrorKind.INTERNAL
            )
            return
        if request.request_id in self._queues:
            yield RequestOutput(
                request.request_id,
                [],
                FinishReason.ERROR,
                f"request id {request.request_id} is already in use",
                ErrorKind.INVALID,
            )
            return
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request.request_id] = outputs
        self._owners[request.request_id] = owner
        finished = False
        try:
            self._send_queue.put_nowait(request)
            while True:
                out = await outputs.get()
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            del self._queues[request.request_id]
            del self._owners[request.request_id]
            if not finished:
                self.abort_nowait([request.request_id])

    def cancel(self, request_id: str, caller: str | None = None) -> bool:
        """Abort an in-flight request of this server, with all its choices (``<id>-<k>``);
        False if there is none by that id that ``caller`` may cancel (a request made with
        an API key is the key's alone)."""
        ids = [
            r
            for r in self._queues
            if (r == request_id or r.startswith(request_id + "-"))
            and self._owners.get(r) in (None, caller)
        ]
        if ids:
            self.abort_nowait(ids)
        return bool(ids)

    @property
    def num_in_flight(self) -> int:
        """Engine requests of this server still running (a choice counts as one)."""
        return len(self._queues)

    def fail_in_flight(self, reason: str) -> None:
        """End every in-flight request with an error now (streams get an error event) and
        abort them in the engine."""
        ids = list(self._queues)
        for request_id in ids:
            self._queues[request_id].put_nowait(
                RequestOutput(request_id, [], FinishReason.ERROR, reason, ErrorKind.INTERNAL)
            )
        if ids:
            self.abort_nowait(ids)

    def forward_cancel(self, request_id: str, caller: str | None) -> None:
        """Ask the engine to cancel a request another API-server process may own."""
        if self.dead_reason is None:
            self._send_queue.put_nowait(CancelRequests(request_id, caller))

    def reset_prefix_cache(self) -> None:
        self._send_queue.put_nowait(ResetPrefixCache())

    def send_control(self, message: LoadLoRAAdapter | UnloadLoRAAdapter) -> None:
        """An order for the engine's own state; its effect shows in a later heartbeat."""
        self._send_queue.put_nowait(message)

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Queue an abort; idempotent on the engine side."""
        if self.dead_reason is None:
            self._send_queue.put_nowait(AbortRequests(request_ids))

    # ------------------------------------------------------------------ tasks

    async def _send_loop(self) -> None:
        while True:
            message = await self._send_queue.get()
            await self._push.send(self._codec.encode(message))  # type: ignore[misc]

    async def _read_loop(self) -> None:
        while True:
            frame = await self._dealer.recv()  # type: ignore[misc]
            try:
                message = self._codec.decode(frame)
            except msgspec.DecodeError as e:
                self.num_malformed_frames += 1
                logger.warning("dropped a malformed frame from the engine: %s", e)
                continue
            if isinstance(message, EngineOutputs):
                if message.stats is not None:
                    self.stats = message.stats
                for out in message.outputs:
                    target = self._queues.get(out.request_id)
                    if target is not None:
                        target.put_nowait(out)
            elif isinstance(message, EngineHeartbeat):
                self._silence.heard()
                self.ready = message.ready
                self.stats = message.stats
                self.model = message.model or self.model
                self.role = message.role
                self.pools = message.pools
                self.kv_transfers = message.kv_transfers
                self.lora_adapters = {a.name: a for a in message.lora_adapters}
            elif isinstance(message, EngineDead):
                self._mark_dead(f"engine core is down: {message.reason}")

    async def _watchdog(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            if self._silence.look() >= DEAD_AFTER_S:
                self._mark_dead(
                    f"engine core stopped answering (no heartbeat for {DEAD_AFTER_S:.0f} s)"
                )

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        logger.error("%s", reason)
        self.dead_reason = reason
        self.ready = False
        for request_id, target in self._queues.items():
            target.put_nowait(
                RequestOutput(request_id, [], FinishReason.ERROR, reason, ErrorKind.INTERNAL)
            )
        if self._on_dead is not None:
            self._on_dead(reason)
