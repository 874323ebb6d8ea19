"""The engine core process: a step loop with an input thread and an output thread.

Input thread: PULL socket -> decoded ``EngineInput`` -> ``_inputs`` queue.
Step loop (main thread): apply inputs, ``schedule`` -> ``execute`` -> ``update``.
Output thread: ``_outputs`` queue -> ROUTER socket, to the API server owning each
request; plus a heartbeat with fresh stats to every client five times a second.
The step loop never touches a socket, so a slow client never stalls a step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import msgspec
import zmq

from common.config import TandemConfig
from common.ipc import Codec, make_socket
from common.messages import (
    AbortRequests,
    ClientHello,
    EngineDead,
    EngineHeartbeat,
    EngineInput,
    EngineOutputs,
    EngineRequest,
    ModelInfo,
    ResetPrefixCache,
    SchedulerStats,
)
from engine_core.executor import WorkerDied, WorkerPool
from engine_core.kv_cache import KVCacheManager
from engine_core.request import Request
from engine_core.scheduler import ClientOutputs, Scheduler

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.2
_IDLE_WAIT_S = 0.1
_FORMING_WAIT_S = 0.005


class EngineCore:
    def __init__(self, config: TandemConfig, runtime_dir: str) -> None:
        self.config = config
        self._inputs: queue.Queue[EngineInput] = queue.Queue()
        self._outputs: queue.Queue[tuple[bytes, EngineOutputs | EngineDead]] = queue.Queue()
        self._stop = threading.Event()
        self._ready = False
        self._model: ModelInfo | None = None
        self._stats = SchedulerStats()
        self.num_malformed_frames = 0
        self._ctx = zmq.Context()
        # Bind before the workers load so API servers can connect (and see "loading").
        input_sock = make_socket(self._ctx, zmq.PULL, config.addresses.input_address, bind=True)
        output_sock = make_socket(self._ctx, zmq.ROUTER, config.addresses.output_address, bind=True)
        self._threads = [
            threading.Thread(
                target=self._input_loop, args=(input_sock,), name="engine-input", daemon=True
            ),
            threading.Thread(
                target=self._output_loop, args=(output_sock,), name="engine-output", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()
        self.pool = WorkerPool("unified", config, runtime_dir)
        self.scheduler: Scheduler | None = None

    # ------------------------------------------------------------------ step loop

    def run(self) -> None:
        """Serve until ``stop()``. Raises ``WorkerDied`` when a worker dies."""
        ready = self.pool.wait_ready()
        kv = KVCacheManager(
            ready.num_kv_blocks, ready.block_size, self.config.scheduler.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.config.scheduler, kv, ready.model)
        self._model = ready.model
        self._stats = self.scheduler.stats()
        self._ready = True
        logger.info(
            "engine ready: %d KV blocks of %d tokens", ready.num_kv_blocks, ready.block_size
        )
        while not self._stop.is_set():
            self._apply_inputs(block=not self.scheduler.has_work())
            if self.scheduler.has_work():
                self.step()
            else:
                self.pool.check_alive()

    def step(self) -> None:
        assert self.scheduler is not None  # set in run()
        work = self.scheduler.schedule()
        self._stats = self.scheduler.stats()  # heartbeats show this step's batch while it runs
        if not work.num_scheduled_tokens and not work.finished_request_ids:
            # Nothing could run (a static batch still forming): wait for input a moment.
            self._apply_inputs(block=True, timeout_s=_FORMING_WAIT_S)
            return
        result = self.pool.execute(work)
        self._emit(self.scheduler.update_from_output(work, result))

    def _apply_inputs(self, block: bool, timeout_s: float = _IDLE_WAIT_S) -> None:
        assert self.scheduler is not None
        try:
            message = self._inputs.get(timeout=timeout_s) if block else self._inputs.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(message, EngineRequest):
                logger.debug(
                    "[%s] received, %d prompt tokens",
                    message.request_id,
                    len(message.prompt_token_ids),
                )
                error = self.scheduler.add_request(Request.from_engine_request(message))
                if error is not None:
                    self._emit({message.client_id: [error]})
            elif isinstance(message, AbortRequests):
                self._emit(self.scheduler.abort_requests(message.request_ids))
            elif isinstance(message, ResetPrefixCache):
                self.scheduler.reset_prefix_cache()
            try:
                message = self._inputs.get_nowait()
            except queue.Empty:
                return

    def _emit(self, outputs: ClientOutputs) -> None:
        assert self.scheduler is not None
        self._stats = stats = self.scheduler.stats()
        for client_id, request_outputs in outputs.items():
            self._outputs.put((client_id, EngineOutputs(request_outputs, stats)))

    def fail(self, reason: str) -> None:
        """End every request with an error and tell every client the engine is dead."""
        if self.scheduler is not None:
            self._emit(self.scheduler.fail_all(reason))
        self._outputs.put((b"", EngineDead(reason)))

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self, flush_timeout_s: float = 1.0) -> None:
        """Flush queued outputs, stop the threads and the workers."""
        deadline = time.monotonic() + flush_timeout_s
        while not self._outputs.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=1.0)
        self.pool.shutdown()
        self._ctx.term()

    # ------------------------------------------------------------------ I/O threads

    def _input_loop(self, sock: zmq.Socket[bytes]) -> None:
        codec: Codec[EngineInput] = Codec(EngineInput)
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            frame = sock.recv()
            try:
                self._inputs.put(codec.decode(frame))
            except msgspec.DecodeError as e:
                self.num_malformed_frames += 1
                logger.warning(
                    "dropped a malformed input frame (%d so far): %s", self.num_malformed_frames, e
                )
        sock.close()

    def _output_loop(self, sock: zmq.Socket[bytes]) -> None:
        # Decodes the only frame clients send here (hellos); encodes any output.
        codec: Codec[ClientHello] = Codec(ClientHello)
        clients: set[bytes] = set()
        next_heartbeat = 0.0
        while not self._stop.is_set():
            while sock.poll(0):  # hellos from API servers that just connected
                identity, frame = sock.recv_multipart()
                try:
                    codec.decode(frame)
                    clients.add(identity)
                except msgspec.DecodeError:
                    self.num_malformed_frames += 1
            try:
                client_id, message = self._outputs.get(timeout=0.02)
                frame = codec.encode(message)
                targets = clients if isinstance(message, EngineDead) else {client_id}
                for target in targets:
                    sock.send_multipart([target, frame])
            except queue.Empty:
                pass
            now = time.monotonic()
            if now >= next_heartbeat:
                beat = codec.encode(EngineHeartbeat(self._ready, self._stats, self._model))
                for target in clients:
                    sock.send_multipart([target, beat])
                next_heartbeat = now + HEARTBEAT_INTERVAL_S
        sock.close()


__all__ = ["EngineCore", "WorkerDied"]
