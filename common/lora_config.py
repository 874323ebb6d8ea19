"""LoRA adapters on the command line, spelled as vLLM's: ``--enable-lora``,
``--lora-modules name=path`` (or vLLM's JSON form ``{"name": ..., "path": ...,
"base_model_name": ...}``), ``--max-loras`` (adapters a step may run at once),
``--max-lora-rank``, ``--max-cpu-loras`` (adapters a worker keeps loaded) and the
runtime routes' opt-in (vLLM reads it from ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; Tandem
takes that or ``--allow-runtime-lora-updating``)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from common.config_checks import require

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_from_env() -> bool:
    """vLLM's switch for ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class LoRAModule:
    """An adapter served from the start: the ``model`` name clients pass, its folder."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """``name=path`` or vLLM's JSON object; a ``ValueError`` naming the flag otherwise."""
    if text.lstrip().startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r} is not JSON: {e}") from None
        require(
            isinstance(raw, dict) and isinstance(raw.get("name"), str) and "path" in raw,
            f"--lora-modules {text!r}: a JSON adapter needs 'name' and 'path'",
        )
        unknown = sorted(set(raw) - {"name", "path", "base_model_name"})
        require(not unknown, f"--lora-modules {text!r}: unknown field {', '.join(unknown)}")
        base = raw.get("base_model_name")
        return LoRAModule(raw["name"], str(raw["path"]), None if base is None else str(base))
    name, sep, path = text.partition("=")
    require(
        bool(sep and name.strip() and path.strip()),
        f"--lora-modules {text!r} must be name=path or a JSON object",
    )
    return LoRAModule(name.strip(), path.strip())


def check_lora_flags(
    enable_lora: bool,
    modules: tuple[str, ...],
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int | None,
) -> None:
    """The flags' values, refused where the config is built."""
    parsed = [parse_lora_module(m) for m in modules]
    require(enable_lora or not parsed, "--lora-modules needs --enable-lora")
    names = [m.name for m in parsed]
    require(len(set(names)) == len(names), "--lora-modules names an adapter twice")
    require(max_loras >= 1, f"--max-loras must be at least 1, got {max_loras}")
    require(max_lora_rank >= 1, f"--max-lora-rank must be at least 1, got {max_lora_rank}")
    require(
        max_cpu_loras is None or max_cpu_loras >= max_loras,
        f"--max-cpu-loras ({max_cpu_loras}) must be at least --max-loras ({max_loras})",
    )


def add_lora_args(parser: argparse.ArgumentParser, max_loras: int, max_lora_rank: int) -> None:
    """The LoRA flags of ``tandem serve`` (``common/cli_args.py`` adds them)."""
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve PEFT LoRA adapters beside the base model: a request names one as its "
        "model (docs/lora.md)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="adapters served from the start: name=path, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'',
    )
    g.add_argument(
        "--max-loras",
        type=int,
        default=max_loras,
        help="distinct adapters one step may run (default: %(default)s)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        default=max_lora_rank,
        help="largest adapter rank accepted (default: %(default)s)",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters a worker keeps loaded, least recently used dropped first "
        "(default: --max-loras)",
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action=argparse.BooleanOptionalAction,
        default=runtime_updating_from_env(),
        help="open POST /v1/load_lora_adapter and /v1/unload_lora_adapter (admin keys only "
        f"when API keys are on); also ${RUNTIME_UPDATING_ENV}=True, as vLLM",
    )
