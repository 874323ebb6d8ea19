"""``EngineCoreProc``: the engine core process around an ``EngineCore``.

Input thread: PULL socket -> decoded ``EngineInput`` -> ``_inputs`` queue (and a byte on
an inproc socket that wakes the step loop). Step loop (main thread): apply inputs, then
``core.step()`` (submit to idle pools, poll all); when nothing progressed it sleeps on a
poller over every pool's socket and the wake socket, so it reacts at once to a worker's
answer or a new request. Output thread: ``_outputs`` queue -> ROUTER socket, to the API
server owning each request, plus heartbeats with fresh stats five times a second. The
step loop never touches a client socket, so a slow client never stalls a step.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from common.config import TandemConfig
from common.curve import CurveKeys
from common.ipc import Codec, make_socket, max_request_frame_bytes
from common.messages import (
    AbortRequests,
    CancelRequests,
    ClientHello,
    EngineDead,
    EngineHeartbeat,
    EngineInput,
    EngineOutputs,
    EngineRequest,
    ErrorKind,
    FinishReason,
    LoadLoRAAdapter,
    PeerMessage,
    PoolRole,
    RequestOutput,
    ResetPrefixCache,
    SchedulerStats,
    UnloadLoRAAdapter,
)
from common.process import freeze_startup_heap
from common.shm import ServiceLock, new_service_id, remove_stale
from common.tracing import start_tracing
from engine_core.core import EngineCore
from engine_core.executor import WorkerDied, WorkerPool
from engine_core.kv_event_publisher import KVEventStreams
from engine_core.kv_side_channel import KVSideChannel
from engine_core.request_spans import request_spans
from engine_core.scheduler import ClientOutputs

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.2
_IDLE_WAIT_MS = 100
_FORMING_WAIT_MS = 5
_WAKE_ADDRESS = "inproc://engine-wake"


class EngineCoreProc:
    def __init__(self, config: TandemConfig, runtime_dir: str) -> None:
        remove_stale()  # segments a crashed engine left behind
        if config.disagg.split and not config.disagg.service_id:
            config = config.with_disagg(service_id=new_service_id())
        self.config = config
        # The claim on this service's shared-memory segments, released at shutdown.
        self._service = ServiceLock(runtime_dir, config.disagg.service_id or new_service_id())
        self._inputs: queue.Queue[EngineInput | tuple[bytes, PeerMessage]] = queue.Queue()
        self._outputs: queue.Queue[tuple[bytes, EngineOutputs | EngineDead]] = queue.Queue()
        self._stop = threading.Event()
        self._drain_deadline: float | None = None  # set by begin_drain
        self._heartbeat = EngineHeartbeat(
            False, SchedulerStats(), role=self.config.disagg.service_role
        )
        self.num_malformed_frames = 0
        self.num_dropped_connections = 0
        self._published_at = 0.0  # when the step loop last refreshed the heartbeat
        self._ctx = zmq.Context()
        keys = CurveKeys(config.addresses.curve_keys) if config.addresses.curve_keys else None
        self._auth = keys.start_authenticator(self._ctx) if keys else None
        secure = keys.make_server if keys else None
        # Bind before the workers load so API servers can connect (and see "loading").
        input_sock = make_socket(
            self._ctx,
            zmq.PULL,
            config.addresses.input_address,
            bind=True,
            max_message_bytes=max_request_frame_bytes(config.server.max_body_bytes),
            secure=secure,
        )
        output_sock = make_socket(
            self._ctx, zmq.ROUTER, config.addresses.output_address, bind=True, secure=secure
        )
        self._wake = self._ctx.socket(zmq.PULL)
        self._wake.bind(_WAKE_ADDRESS)
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
        self.pools: dict[PoolRole, WorkerPool] = {
            spec.role: WorkerPool(spec, config, runtime_dir) for spec in config.disagg.pool_specs()
        }
        self._tracing = start_tracing(config.server.otlp_traces_endpoint, "tandem-engine-core")
        spans = request_spans(self._tracing, config.served_model_name)
        self.core = EngineCore(config, self.pools, spans=spans)
        self._side_wake: zmq.Socket[bytes] | None = None
        self._side_channel = self._open_side_channel(keys)
        self._kv_events = KVEventStreams(self._ctx, config.cache.kv_events, [])  # at start
        self._poller = zmq.Poller()
        self._poller.register(self._wake, zmq.POLLIN)
        for pool in self.pools.values():
            self._poller.register(pool.sock, zmq.POLLIN)

    @property
    def ready(self) -> bool:
        return self.core.ready

    def _open_side_channel(self, keys: CurveKeys | None) -> KVSideChannel | None:
        """A fleet's prefill/decode split: the socket to other instances' engines."""
        instance = self.config.disagg.instance_kv
        if not (instance.role.produces or instance.role.consumes):
            return None
        bind = instance.side_channel_address if instance.role.produces else None
        wake = self._ctx.socket(zmq.PUSH)  # used by the side channel's thread alone
        wake.connect(_WAKE_ADDRESS)

        def deliver(peer: bytes, message: PeerMessage) -> None:
            self._inputs.put((peer, message))
            with contextlib.suppress(zmq.Again):
                wake.send(b"", zmq.NOBLOCK)

        self._side_wake = wake
        return KVSideChannel(
            self._ctx,
            bind,
            deliver,
            keys.make_server if keys else None,
            keys.make_client if keys else None,
        )

    # ------------------------------------------------------------------ step loop

    def run(self) -> None:
        """Serve until ``stop()``, or drained. Raises ``WorkerDied`` when a worker dies."""
        self.core.start()
        self._kv_events = KVEventStreams(
            self._ctx, self.config.cache.kv_events, self.core.kv_managers()
        )
        freeze_startup_heap()
        self._publish()
        managers = {str(r): s.scheduler.kv.num_blocks for r, s in self.core.slots.items()}
        logger.info(
            "engine ready (%s): KV blocks per pool %s", self.config.disagg.service_role, managers
        )
        while not self._stop.is_set():
            self._apply_inputs()
            result = self.core.step()
            self._send_to_peers()
            self._kv_events.flush()
            if result.outputs:
                self._emit(result.outputs)
            elif result.progressed:
                self._publish()
            if self._drain_deadline is not None and self._drained():
                return
            if not result.progressed:
                self.core.check_alive()
                if time.monotonic() - self._published_at > HEARTBEAT_INTERVAL_S:
                    self._publish()  # idle, yet leases expire and pulls time out
                busy = self.core.has_work()
                self._wait(
                    _FORMING_WAIT_MS if busy and not self._any_in_flight() else _IDLE_WAIT_MS
                )

    def _any_in_flight(self) -> bool:
        return any(slot.in_flight for slot in self.core.slots.values())

    def _wait(self, timeout_ms: int) -> None:
        """Sleep until a worker answers, a request comes, or the timeout."""
        ready = dict(self._poller.poll(timeout_ms))
        if self._wake in ready:
            while self._wake.poll(0):
                self._wake.recv()

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def begin_drain(self, timeout_s: float) -> None:
        """Refuse new requests from now on; ``run`` returns once the running ones have
        finished, or after ``timeout_s`` with the rest failed."""
        self._drain_deadline = time.monotonic() + timeout_s

    def _drained(self) -> bool:
        assert self._drain_deadline is not None
        # Leases too: a decode instance may still pull a prompt this instance answered.
        if not self.core.num_requests and not self.core.remote.num_leases:
            return True
        if time.monotonic() < self._drain_deadline:
            return False
        logger.warning("shutdown timeout: ending %d request(s)", self.core.num_requests)
        self._emit(
            self.core.fail_all("the engine shut down before this request finished", "aborted")
        )
        return True

    def _apply_inputs(self) -> None:
        while True:
            try:
                message = self._inputs.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, EngineRequest):
                self._add_request(message)
            elif isinstance(message, AbortRequests):
                self._emit(self.core.abort(message.request_ids))
            elif isinstance(message, CancelRequests):
                self._emit(self.core.cancel(message.request_id, message.owner))
            elif isinstance(message, ResetPrefixCache):
                self.core.reset_prefix_cache()
            elif isinstance(message, LoadLoRAAdapter):
                self.core.loras.load(message.name, message.path)
                self._publish()
            elif isinstance(message, UnloadLoRAAdapter):
                self.core.loras.unload(message.name)
                self._publish()
            elif isinstance(message, tuple):  # from another instance's engine
                replied = self.core.deliver(*message)
                if replied:
                    self._emit(replied)

    def _send_to_peers(self) -> None:
        for to, message in self.core.take_peer_outbox():
            if self._side_channel is not None:
                self._side_channel.send(to, message)

    def _add_request(self, message: EngineRequest) -> None:
        logger.debug(
            "[%s] received, %d prompt tokens", message.request_id, len(message.prompt_token_ids)
        )
        if self.draining:
            refusal = RequestOutput(
                message.request_id,
                [],
                FinishReason.ERROR,
                "the engine is shutting down; retry on another replica",
                ErrorKind.OVERLOADED,
            )
            self._send({message.client_id: [refusal]})
            return
        refusal_outputs = self.core.add_request(message)  # their traces ended there
        if refusal_outputs:
            self._send(refusal_outputs)

    def _emit(self, outputs: ClientOutputs) -> None:
        self.core.spans.finished(outputs)  # every request's last output passes here
        self._send(outputs)

    def _send(self, outputs: ClientOutputs) -> None:
        stats = self._publish()
        for client_id, request_outputs in outputs.items():
            self._outputs.put((client_id, EngineOutputs(request_outputs, stats)))

    def _publish(self) -> SchedulerStats:
        """Refresh the heartbeat's figures; returns the totals."""
        self._published_at = time.monotonic()
        core = self.core
        stats = msgspec.structs.replace(
            core.stats(),
            num_malformed_frames_total=self.num_malformed_frames,
            num_dropped_connections_total=self.num_dropped_connections,
        )
        self._heartbeat = EngineHeartbeat(
            core.ready,
            stats,
            core.model,
            self.config.disagg.service_role,
            {str(role): s for role, s in core.pool_stats().items()}
            if self.config.disagg.split
            else {},
            core.transfer_stats(),
            core.loras.adapters,
        )
        return stats

    def _fresh_heartbeat(self) -> EngineHeartbeat:
        """The latest heartbeat, with the input socket's counters as of now (they change
        between steps, even when the engine is idle)."""
        beat = self._heartbeat
        stats = msgspec.structs.replace(
            beat.stats,
            num_malformed_frames_total=self.num_malformed_frames,
            num_dropped_connections_total=self.num_dropped_connections,
        )
        return msgspec.structs.replace(beat, stats=stats)

    def fail(self, reason: str) -> None:
        """End every request with an error and tell every client the engine is dead."""
        if self.core.ready:
            self._emit(self.core.fail_all(reason))
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
        for pool in self.pools.values():
            pool.shutdown()
        self._kv_events.close()
        if self._side_channel is not None:
            self._side_channel.close()
        if self._side_wake is not None:
            self._side_wake.close(linger=0)
        self._wake.close()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        self._service.release()
        self._tracing.shutdown()

    # ------------------------------------------------------------------ I/O threads

    def _input_loop(self, sock: zmq.Socket[bytes]) -> None:
        """Decode requests for the step loop. Undecodable frames are dropped and counted;
        a peer that sends a frame over the size limit is disconnected by ZeroMQ, which the
        socket monitor reports (counted with peers that simply went away)."""
        codec: Codec[EngineInput] = Codec(EngineInput)
        wake = self._ctx.socket(zmq.PUSH)
        wake.connect(_WAKE_ADDRESS)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if monitor in ready:
                recv_monitor_message(monitor)
                self.num_dropped_connections += 1
                logger.info(
                    "an input connection closed (%d so far): its peer went away, or sent a "
                    "frame over the size limit",
                    self.num_dropped_connections,
                )
            if sock not in ready:
                continue
            frame = sock.recv()
            try:
                self._inputs.put(codec.decode(frame))
            except msgspec.DecodeError as e:
                self.num_malformed_frames += 1
                logger.warning(
                    "dropped a malformed input frame (%d so far): %s", self.num_malformed_frames, e
                )
                continue
            with contextlib.suppress(zmq.Again):  # a full wake queue: the loop is awake
                wake.send(b"", zmq.NOBLOCK)
        sock.disable_monitor()
        monitor.close()
        wake.close()
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
                beat = codec.encode(self._fresh_heartbeat())
                for target in clients:
                    sock.send_multipart([target, beat])
                next_heartbeat = now + HEARTBEAT_INTERVAL_S
        sock.close()


__all__ = ["EngineCoreProc", "WorkerDied"]
