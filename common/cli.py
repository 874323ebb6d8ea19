"""The ``tandem`` command."""

from __future__ import annotations

import argparse
import sys

from common.cli_args import add_cli_args
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
    keys = commands.add_parser(
        "keys",
        help="make the CurveZMQ key pairs a deployment's processes share (--curve-keys DIR)",
    )
    keys.add_argument("directory", help="where to write server.key[_secret], client.key[_secret]")
    args = parser.parse_args(argv)
    if args.command == "keys":
        from common.curve import generate_keys

        print(f"CurveZMQ keys written to {generate_keys(args.directory)}")
        return
    try:
        config = TandemConfig.from_cli_args(args)
    except ValueError as e:
        serve.error(str(e))
    setup_logging(config.server.log_level, "tandem")
    from common.launcher import serve as run_serve

    try:
        sys.exit(run_serve(config))
    except ValueError as e:  # e.g. an unknown --model
        print(f"tandem: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
