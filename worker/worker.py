"""The worker process: load the model, say ready, then run steps until told to stop.

It talks only to its engine core, over one DEALER socket (identity ``worker-<rank>``),
plus, when the engine did not start it (``--external-workers``), a heartbeat socket fed
by a thread. A decode worker of split pools over TCP also takes KV on its own socket
(``worker/kv_transfer.py``) and reports landed transfers between steps.

Its engine ends it with ``Shutdown``. SIGTERM (a container runtime stopping every
process at once) does not: the engine may be draining its last requests through this
worker, so the worker keeps serving for ``--shutdown-timeout`` (plus the grace period)
and only then exits. If the Tandem engine that started it dies, the kernel sends SIGHUP,
which ends it at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

import zmq

from common.config import TandemConfig
from common.curve import CurveKeys
from common.ipc import Codec, make_socket
from common.messages import (
    KVTransferStatus,
    PoolRole,
    Shutdown,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerInput,
    WorkerReady,
)
from common.model_files import resolve_model_dir
from common.process import die_with_parent, freeze_startup_heap, release_free_memory
from worker.engine_link import EngineLink, enable_heartbeats
from worker.models.quantizers import quantizer_for
from worker.thread_governor import ThreadGovernor

logger = logging.getLogger(__name__)

_POLL_MS = 500
HEARTBEAT_INTERVAL_S = 0.5
# For tests only: ``raise-on-step=N`` makes this worker raise during its N-th step, as a
# failing forward pass would. Never set in production; documented in docs/reliability.md.
FAULT_INJECTION_ENV = "TANDEM_FAULT_INJECTION"
# oneDNN and ideep (PyTorch's bfloat16 matmuls on CPU) cache a primitive per input shape,
# up to 1,024 each by default: as a server sees every step size, a worker grew by ~0.5 GB
# over hours of traffic. 256 each bounds it (measured: a 1,500-request soak of random
# lengths grew 8% instead of 25%, no slower). Set before torch loads; the user's own wins.
SHAPE_CACHE_DEFAULTS = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "256"}


class InjectedFault(RuntimeError):
    """The failure ``TANDEM_FAULT_INJECTION`` asked for."""


def _fault_step() -> int | None:
    spec = os.environ.get(FAULT_INJECTION_ENV, "")
    if not spec:
        return None
    name, _, value = spec.partition("=")
    if name != "raise-on-step" or not value.isdigit():
        raise ValueError(f"{FAULT_INJECTION_ENV}={spec!r}: expected raise-on-step=N")
    return int(value)


class _TermDeadline:
    """SIGTERM starts a deadline instead of ending the process."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.at: float | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.at is None:
            self.at = time.monotonic() + self.after_s
            logger.info("SIGTERM: serving the engine for up to %.0f s more", self.after_s)

    @property
    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


def _heartbeats(
    ctx: zmq.Context[Any],
    address: str,
    rank: int,
    stop: threading.Event,
    secure: Callable[[zmq.Socket[Any]], None] | None,
) -> None:
    """Prove this worker alive to an engine that did not start it, even mid-step."""
    sock = make_socket(
        ctx,
        zmq.DEALER,
        address,
        bind=False,
        identity=f"heartbeat-{rank}".encode(),
        secure=secure,
    )
    frame = Codec(WorkerHeartbeat).encode(WorkerHeartbeat(rank))
    while not stop.wait(HEARTBEAT_INTERVAL_S):
        sock.send(frame)
    sock.close()


def _thread_governor(config: TandemConfig) -> ThreadGovernor | None:
    """The step loop's thread governor; None with ``--no-adaptive-worker-threads``."""
    import torch

    if not config.disagg.adaptive_worker_threads:
        return None
    return ThreadGovernor(config.disagg.threads_per_worker(), torch.set_num_threads)


def _build_runner(
    config: TandemConfig,
    pool: PoolRole,
    rank: int,
    tp_init_address: str | None,
    ctx: zmq.Context[Any],
    keys: CurveKeys | None,
) -> Any:
    import torch

    from worker.device import pick_device, resolve_dtype
    from worker.kv_wiring import kv_segment, kv_transport
    from worker.model_runner import ModelRunner
    from worker.parallel import init_group

    torch.set_num_threads(config.disagg.threads_per_worker())
    device = pick_device()
    dtype = resolve_dtype(config.model.dtype, device, config.model.attention_backend)
    ranks = config.disagg.tp_size(pool)
    if ranks > 1 and not tp_init_address:
        raise ValueError("tensor parallelism needs --tp-init-address (the engine sets it)")
    # With async scheduling the next step leaves the engine before this one's tokens
    # arrive there, so ranks > 0 take them from rank 0 directly.
    broadcast = config.scheduler.async_scheduling
    tp = init_group(rank, ranks, tp_init_address or "", device, broadcast)
    runner = ModelRunner(
        resolve_model_dir(config.model.model),
        dtype,
        device,
        config.cache,
        config.model.max_model_len,
        config.model.attention_backend,
        kv_segment(config.disagg, pool, rank),
        tp,
        quantizer_for(config.model.quantization, config.model.model, config.model.gguf_activations),
        config.model.worker_lora_capacity if config.model.enable_lora else 0,
    )
    runner.attach_transport(kv_transport(runner, config, pool, ctx, keys))
    runner.warm_up()
    logger.info("%s worker ready on %s (%d torch threads)", pool, device, torch.get_num_threads())
    return runner


def run_worker(
    config: TandemConfig,
    rank: int,
    engine_address: str,
    pool: PoolRole = PoolRole.UNIFIED,
    tp_init_address: str | None = None,
) -> int:
    for key, value in SHAPE_CACHE_DEFAULTS.items():
        os.environ.setdefault(key, value)
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we stop
    term = _TermDeadline(config.server.shutdown_timeout_s + config.server.grace_period_s)
    signal.signal(signal.SIGTERM, term)
    ctx = zmq.Context()
    # With --curve-keys every socket to the engine is a Curve client, and a decode
    # worker's KV receiver a Curve server that admits only the deployment's prefill workers.
    keys = CurveKeys(config.addresses.curve_keys) if config.addresses.curve_keys else None
    auth = keys.start_authenticator(ctx) if keys else None
    secure = keys.make_client if keys else None
    external = config.disagg.external_workers

    def secure_and_watch(s: zmq.Socket[Any]) -> None:
        if secure is not None:
            secure(s)
        if external:
            enable_heartbeats(s)

    sock = make_socket(
        ctx,
        zmq.DEALER,
        engine_address,
        bind=False,
        identity=f"worker-{rank}".encode(),
        secure=secure_and_watch,
    )
    link = EngineLink(sock) if external else None
    codec: Codec[WorkerInput] = Codec(WorkerInput)
    stop_heartbeats = threading.Event()
    runner: Any = None
    notify: zmq.Socket[bytes] | None = None
    if external:
        threading.Thread(
            target=_heartbeats,
            args=(ctx, engine_address, rank, stop_heartbeats, secure),
            name="heartbeat",
            daemon=True,
        ).start()
    try:
        runner = _build_runner(config, pool, rank, tp_init_address, ctx, keys)
        # The load's read buffers and the float projections that packing or GGUF blocks
        # replaced are free but still mapped: return them before the first step, after
        # the freeze's collection has freed what only it could.
        freeze_startup_heap()
        release_free_memory()
        transport = runner.kv_transport
        ready = WorkerReady(
            rank,
            runner.num_kv_blocks,
            runner.block_size,
            runner.model_info,
            pool,
            transport.address,
            runner.bytes_per_block,
        )
        sock.send(codec.encode(ready))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if link is not None:
            poller.register(link.events, zmq.POLLIN)
        if transport.wakes_worker:
            from worker.kv_transfer import NOTIFY_ADDRESS

            notify = ctx.socket(zmq.PULL)
            notify.connect(NOTIFY_ADDRESS)
            poller.register(notify, zmq.POLLIN)
        governor = _thread_governor(config)
        fixed_threads = config.disagg.threads_per_worker()
        fault_step = _fault_step()
        num_steps = 0
        trimmed = True
        while True:
            ready_socks = dict(poller.poll(_POLL_MS))
            if notify is not None and notify in ready_socks:
                while notify.poll(0):
                    notify.recv()
                results = runner.transfer_results()  # landed while idle: tell the engine now
                if results:
                    sock.send(codec.encode(KVTransferStatus(rank, results)))
            if sock not in ready_socks:
                if link is not None and link.lost():
                    logger.error(
                        "worker %d: the engine at %s went away; exiting for a restart",
                        rank,
                        engine_address,
                    )
                    return 1
                if term.passed:
                    logger.info("worker %d: shutdown deadline passed; exiting", rank)
                    return 0
                if not trimmed:  # idle: hand the allocator's free memory back to the OS
                    release_free_memory()
                    if governor is not None:
                        governor.idle()
                    trimmed = True
                continue
            trimmed = False
            message = codec.decode(sock.recv())
            if isinstance(message, Shutdown):
                return 0
            num_steps += 1
            if num_steps == fault_step:
                raise InjectedFault(f"fault injected on step {num_steps} ({FAULT_INJECTION_ENV})")
            started = time.perf_counter()
            output = runner.execute(message)
            # What this step ran on; the governor may change it for the next one.
            output.num_threads = governor.threads if governor is not None else fixed_threads
            sock.send(codec.encode(output))
            if governor is not None:  # after the send: its /proc reads never delay a step
                governor.step_done(time.perf_counter() - started)
    except Exception as e:
        logger.error("worker %d failed: %s", rank, traceback.format_exc())
        sock.send(codec.encode(WorkerFailed(rank, f"{type(e).__name__}: {e}")))
        return 1
    finally:
        stop_heartbeats.set()
        if runner is not None:
            runner.close()
            from worker.parallel import destroy_group

            destroy_group(runner.tp)
        if notify is not None:
            notify.close()
        if link is not None:
            link.close()
        sock.close()
        if auth is not None:
            auth.stop()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    import argparse

    from common.cli_args import add_cli_args
    from common.env_flags import apply_env_defaults
    from common.logs import setup_logging

    parser = argparse.ArgumentParser(prog="python -m worker")
    add_cli_args(parser)
    parser.add_argument("--rank", type=int, default=0, help="rank of this worker in its pool")
    parser.add_argument(
        "--worker-address", default=None, help="the engine's ZeroMQ address for this pool"
    )
    parser.add_argument(
        "--pool",
        default=str(PoolRole.UNIFIED),
        choices=[str(role) for role in PoolRole],
        help="the pool this worker serves (default: %(default)s)",
    )
    parser.add_argument(
        "--tp-init-address",
        default=None,
        help="tensor parallelism: the ranks' torch.distributed rendezvous (tcp://HOST:PORT)",
    )
    apply_env_defaults(parser)  # TANDEM_POOL, TANDEM_RANK, TANDEM_WORKER_ADDRESS too
    args = parser.parse_args(argv)
    if not args.worker_address:
        parser.error("--worker-address (or TANDEM_WORKER_ADDRESS) is required")
    config = TandemConfig.from_cli_args(args)
    pool = PoolRole[args.pool.upper()]
    name = f"worker-{args.rank}" if pool == PoolRole.UNIFIED else f"{pool}-worker-{args.rank}"
    setup_logging(config.server.log_level, name)
    return run_worker(config, args.rank, args.worker_address, pool, args.tp_init_address)
