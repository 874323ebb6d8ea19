"""Several base models behind one server, as llama.cpp's router mode serves them:
``tandem serve --model A --model B`` runs one Tandem service (engine core, pools, API
server) per model behind a model router on ``--port`` that routes each request by its
``model``; ``--models-max N`` keeps at most N of them loaded, the least recently used
unloaded first and loaded again when a request names it (the request waits up to
``--model-load-timeout`` seconds, then gets 503 with Retry-After)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.config_checks import require

DEFAULT_LOAD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ModelSetConfig:
    """The models beyond the first ``--model`` and how many stay loaded."""

    # Given back as more ``--model`` flags (``TandemConfig.to_cli_args``).
    more_models: tuple[str, ...] = field(default=(), metadata={"flag": "--model"})
    models_max: int = 0  # 0: every model stays loaded
    model_load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S

    def __post_init__(self) -> None:
        require(self.models_max >= 0, f"--models-max must not be negative, got {self.models_max}")
        require(
            self.model_load_timeout_s > 0,
            f"--model-load-timeout-s must be positive, got {self.model_load_timeout_s}",
        )


def model_name_of(model: str) -> str:
    """The id clients send for ``--model`` (no ``--served-model-name``): the embedded
    name or the directory's (or file's) basename, as a single-model server names it."""
    return os.path.basename(os.path.normpath(model))


def check_model_set(models: Sequence[str], served_model_name: str | None, lora: bool) -> None:
    """What several models refuse, said where the config is built."""
    if len(models) < 2:
        return
    names = [model_name_of(m) for m in models]
    twice = sorted({n for n in names if names.count(n) > 1})
    require(not twice, f"--model names {', '.join(twice)} more than once")
    require(
        served_model_name is None,
        "--served-model-name names one model; with several --model each is served by its "
        "own name (the embedded name or the directory's basename)",
    )
    require(not lora, "--enable-lora serves adapters of one base model: give one --model")


class ModelsAction(argparse._AppendAction):
    """``--model``, repeatable: the first one on the command line replaces the default
    (or ``TANDEM_MODEL``'s), the next ones add models, so a command line wins over the
    environment as every flag does."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        models = [] if current is self.default or current is None else list(current)
        setattr(namespace, self.dest, [*models, values])


def add_model_set_args(parser: argparse.ArgumentParser) -> None:
    """The flags of several models (``common/cli_args.py`` adds ``--model`` itself)."""
    g = parser.add_argument_group("several models (llama.cpp's router mode)")
    g.add_argument(
        "--models-max",
        type=int,
        default=0,
        help="with several --model: keep at most this many loaded, unloading the least "
        "recently used and loading a model again when a request names it (default: 0, all)",
    )
    g.add_argument(
        "--model-load-timeout-s",
        type=float,
        default=DEFAULT_LOAD_TIMEOUT_S,
        help="a request for a model being loaded (or waiting for a slot) waits this long, "
        "then gets 503 with Retry-After (default: %(default)s)",
    )
