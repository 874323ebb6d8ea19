"""Every flag of ``tandem serve`` can also come from the environment, as containers and
Helm charts set it: ``--max-num-seqs 32`` is ``TANDEM_MAX_NUM_SEQS=32``; on/off flags
take ``1/true/yes/on`` or ``0/false/no/off``; repeatable ones take a comma-separated
list. A flag on the command line wins over the environment."""

from __future__ import annotations

import argparse
import os

ENV_PREFIX = "TANDEM_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.removeprefix("--").upper().replace("-", "_")


def apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """Set each flag's default from its ``TANDEM_<FLAG>`` variable, where one is set."""
    for action in parser._actions:
        flags = [
            o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")
        ]
        if not flags or action.dest == "help":
            continue
        raw = os.environ.get(env_name(flags[0]))
        if raw is None:
            continue
        value: object
        if isinstance(
            action,
            argparse.BooleanOptionalAction | argparse._StoreTrueAction | argparse._StoreFalseAction,
        ):
            if raw.lower() not in (*_TRUE, *_FALSE):
                parser.error(f"{env_name(flags[0])}={raw!r}: expected true or false")
            value = raw.lower() in _TRUE
            if isinstance(action, argparse._StoreFalseAction):
                value = not value  # TANDEM_X=1 means "pass --x", which stores False
        elif isinstance(action, argparse._AppendAction):
            value = [v.strip() for v in raw.split(",") if v.strip()]
        else:
            try:
                value = action.type(raw) if callable(action.type) else raw
            except ValueError:
                parser.error(f"{env_name(flags[0])}={raw!r} is not a valid {flags[0]}")
            if action.choices is not None and value not in action.choices:
                parser.error(
                    f"{env_name(flags[0])}={raw!r}: one of {', '.join(map(str, action.choices))}"
                )
        action.default = value
