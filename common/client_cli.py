"""``tandem chat``, ``tandem complete`` and ``tandem status``: a running server used from
a terminal or a pipe. The flags are declared here, ``tandem complete`` runs here, the
chat loop lives in ``client_chat.py`` and the status screen in ``client_status.py``.

``complete`` writes the streamed text to stdout as it comes, nothing else: a trailing
newline only when stdout is a terminal, so ``tandem complete "x" | wc -c`` counts the
completion alone. Every failure is one line on stderr and a non-zero exit: 1 when the
server answers an error (its message) or cannot be reached, 130 after Ctrl-C."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from common.client_http import API_KEY_ENV, DEFAULT_URL, URL_ENV, ClientError, TandemClient

CLIENT_COMMANDS = ("chat", "complete", "status")
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped
# OpenAI's completions default is 16 tokens, short for a terminal; chat's is the rest of
# the context, which the server applies when none is sent.
COMPLETE_MAX_TOKENS = 256


def add_client_commands(commands: Any) -> None:
    """The three client subcommands of ``tandem`` (``commands``: its subparsers)."""
    chat = commands.add_parser(
        "chat",
        help="chat with a running server in the terminal (streamed replies)",
        description="Chat with a running Tandem server over /v1/chat/completions. The "
        "conversation is kept across turns; Ctrl-C stops a reply, Ctrl-D or /exit ends.",
    )
    _add_connection_args(chat)
    _add_generation_args(chat, default_max_tokens=None)
    complete = commands.add_parser(
        "complete",
        help="stream a completion of a prompt to stdout",
        description="Stream /v1/completions' text for PROMPT to stdout (errors on stderr, "
        "non-zero exit).",
    )
    complete.add_argument(
        "prompt", nargs="?", default=None, help="the prompt; none or - reads it from stdin"
    )
    _add_connection_args(complete)
    _add_generation_args(complete, default_max_tokens=COMPLETE_MAX_TOKENS)
    status = commands.add_parser(
        "status",
        help="one screen of a running server: health, models, queue, KV cache",
        description="Health and readiness, the models, the queue and KV-cache usage "
        "(/stats) of a running server; exits 1 unless it is healthy.",
    )
    _add_connection_args(status)


def _add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=os.environ.get(URL_ENV, DEFAULT_URL),
        help=f"the server (default: ${URL_ENV}, else {DEFAULT_URL}); an https:// server "
        "signed by a private CA is trusted with SSL_CERT_FILE=ca.pem",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"sent as Authorization: Bearer KEY (default: ${API_KEY_ENV})",
    )


def _add_generation_args(parser: argparse.ArgumentParser, default_max_tokens: int | None) -> None:
    parser.add_argument(
        "--model", default=None, help="the model to ask (default: the first of /v1/models)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=default_max_tokens,
        help="most tokens of a reply (default: "
        + (f"{default_max_tokens})" if default_max_tokens else "the rest of the context)"),
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature, 0 = greedy (default: the model's, else 1.0)",
    )


def sampling_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields the flags set; the server's defaults fill in the others."""
    fields: dict[str, Any] = {}
    if args.max_tokens is not None:
        fields["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        fields["temperature"] = args.temperature
    return fields


def run_client(args: argparse.Namespace) -> int:
    """Run one client subcommand; its exit code."""
    client = TandemClient(args.url, args.api_key)
    try:
        if args.command == "status":
            from common.client_status import show_status

            return show_status(client)
        if args.command == "chat":
            from common.client_chat import Chat

            return Chat(client, args.model or client.first_model(), sampling_fields(args)).run()
        return complete(client, args)
    except ClientError as e:
        print(f"tandem {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        client.close()


def complete(client: TandemClient, args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt in (None, "-") else args.prompt
    body = {
        "model": args.model or client.first_model(),
        "prompt": prompt,
        **sampling_fields(args),
    }
    out = sys.stdout
    try:
        for event in client.stream("/v1/completions", body):
            for choice in event.get("choices") or []:
                out.write(choice.get("text") or "")
            out.flush()
        if out.isatty():
            out.write("\n")
        out.flush()
    except BrokenPipeError:
        # The reader left (`| head`): not an error. Python would report the failed flush
        # of stdout at exit, so it points at /dev/null from here on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
    return 0
