"""The worker process: load the model, say ready, then run steps until told to stop.

It talks only to its engine core, over one DEALER socket (identity ``worker-<rank>``).
If the engine dies, the kernel ends this process too (parent-death signal).
"""

from __future__ import annotations

import logging
import signal
import sys
import traceback

import zmq

from common.config import TandemConfig
from common.ipc import Codec, make_socket
from common.messages import Shutdown, WorkerFailed, WorkerInput, WorkerReady
from common.model_files import resolve_model_dir
from common.process import die_with_parent

logger = logging.getLogger(__name__)


def run_worker(config: TandemConfig, rank: int, engine_address: str) -> int:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we stop
    ctx = zmq.Context()
    sock = make_socket(
        ctx, zmq.DEALER, engine_address, bind=False, identity=f"worker-{rank}".encode()
    )
    codec: Codec[WorkerInput] = Codec(WorkerInput)
    try:
        import torch

        from worker.device import pick_device, resolve_dtype
        from worker.model_runner import ModelRunner

        device = pick_device()
        dtype = resolve_dtype(config.model.dtype, device)
        runner = ModelRunner(
            resolve_model_dir(config.model.model),
            dtype,
            device,
            config.cache,
            config.model.max_model_len,
            config.model.attention_backend,
        )
        runner.warm_up()
        logger.info(
            "worker %d ready on %s (%d torch threads)", rank, device, torch.get_num_threads()
        )
        sock.send(
            codec.encode(
                WorkerReady(rank, runner.num_kv_blocks, runner.block_size, runner.model_info)
            )
        )
        while True:
            message = codec.decode(sock.recv())
            if isinstance(message, Shutdown):
                return 0
            sock.send(codec.encode(runner.execute(message)))
    except Exception as e:
        logger.error("worker %d failed: %s", rank, traceback.format_exc())
        sock.send(codec.encode(WorkerFailed(rank, f"{type(e).__name__}: {e}")))
        return 1
    finally:
        sock.close()
        ctx.term()


def main(argv: list[str] | None = None) -> None:
    import argparse

    from common.cli_args import add_cli_args
    from common.logs import setup_logging

    parser = argparse.ArgumentParser(prog="python -m worker")
    add_cli_args(parser)
    parser.add_argument("--rank", type=int, default=0, help="rank of this worker in its pool")
    parser.add_argument(
        "--worker-address", required=True, help="the engine's ZeroMQ address for this pool"
    )
    args = parser.parse_args(argv)
    config = TandemConfig.from_cli_args(args)
    setup_logging(config.server.log_level, f"worker-{args.rank}")
    sys.exit(run_worker(config, args.rank, args.worker_address))


if __name__ == "__main__":
    main()
