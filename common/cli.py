"""The ``tandem`` command."""

from __future__ import annotations

import argparse
import sys

from common.cli_args import add_cli_args
from common.client_cli import CLIENT_COMMANDS, add_client_commands, run_client
from common.config import TandemConfig
from common.logs import setup_logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: an LLM serving system.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="start the engine core, its workers and the API server",
        description="Serve a model over the OpenAI HTTP API. Every flag has a default; "
        "with none, this serves the embedded SmolLM2-135M-Instruct on 127.0.0.1:8000.",
    )
    add_cli_args(serve)
    fleet = commands.add_parser(
        "fleet",
        help="try a fleet on this host: Tandem instances behind vLLM's router",
        description="Start --replicas Tandem instances (each `tandem serve` with these "
        "flags, on 127.0.0.1 from --instance-base-port, KV events on from "
        "--kv-events-base-port) and vllm-router in front on --host/--port. Needs "
        "pip install 'tandem[router]'.",
    )
    add_fleet_args(fleet)
    add_cli_args(fleet)
    keys = commands.add_parser(
        "keys",
        help="make the CurveZMQ key pairs a deployment's processes share (--curve-keys DIR)",
    )
    keys.add_argument("directory", help="where to write server.key[_secret], client.key[_secret]")
    add_client_commands(commands)  # chat, complete, status: a running server, from a terminal
    args = parser.parse_args(argv)
    if args.command in CLIENT_COMMANDS:
        sys.exit(run_client(args))
    if args.command == "keys":
        from common.curve import generate_keys

        print(f"CurveZMQ keys written to {generate_keys(args.directory)}")
        return
    parser_of = {"serve": serve, "fleet": fleet}
    try:
        config = TandemConfig.from_cli_args(args)
    except ValueError as e:
        parser_of[args.command].error(str(e))
    if args.command == "fleet":
        sys.exit(_run_fleet(config, args, fleet))
    setup_logging(config.server.log_level, "tandem")
    from common.launcher import serve as run_serve

    try:
        sys.exit(run_serve(config))
    except ValueError as e:  # e.g. an unknown --model
        print(f"tandem: {e}", file=sys.stderr)
        sys.exit(2)


def add_fleet_args(parser: argparse.ArgumentParser) -> None:
    from common.fleet import ROUTER_POLICIES

    f = parser.add_argument_group("fleet")
    f.add_argument("--replicas", type=int, default=2, help="instances (default: %(default)s)")
    f.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="prefill instances (kv_producer) of a split fleet, with --decode; replaces "
        "--replicas (default: a fleet of whole instances)",
    )
    f.add_argument(
        "--decode", type=int, default=0, help="decode instances (kv_consumer), with --prefill"
    )
    f.add_argument(
        "--kv-side-channel-base-port",
        type=int,
        default=14579,
        help="prefill instance i takes decode instances' pulls on this port + i "
        "(default: %(default)s)",
    )
    f.add_argument(
        "--policy",
        default="kv_aware",
        choices=ROUTER_POLICIES,
        help="the router's policy; kv_aware reads the instances' KV events (default: %(default)s)",
    )
    f.add_argument(
        "--instance-base-port",
        type=int,
        default=8100,
        help="instance i serves HTTP on this port + i (default: %(default)s)",
    )
    f.add_argument(
        "--kv-events-base-port",
        type=int,
        default=5557,
        help="instance i publishes KV events on this port + 2i, replays on + 2i + 1 "
        "(default: %(default)s)",
    )


def _run_fleet(
    config: TandemConfig, args: argparse.Namespace, parser: argparse.ArgumentParser
) -> int:
    from common.fleet import Shape, plan_fleet, run_fleet

    try:
        plan = plan_fleet(
            config,
            Shape(args.replicas, args.prefill, args.decode),
            args.policy,
            args.instance_base_port,
            args.kv_events_base_port,
            side_channel_base_port=args.kv_side_channel_base_port,
        )
        return run_fleet(plan)
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
