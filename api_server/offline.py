"""The offline Python API for batch jobs: ``LLM(model=...).generate(prompts, params)``.

An ``LLM`` starts the same engine core (which starts its workers) that ``tandem serve``
runs, by the same command, and talks to it over the same ZeroMQ sockets through the
API server's ``EngineClient`` and ``CompletionService``, so a batch job gets the
scheduler, prefix cache and detokenizer the server has. The client lives on an event
loop in a background thread; ``generate`` submits every prompt at once (the engine
batches them) and blocks until all are done. ``close()`` (or leaving a ``with`` block)
stops the engine and its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import subprocess
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from api_server.client import EngineClient
from api_server.errors import ApiError
from api_server.generation import CompletionService, EngineRequestError, Piece, TextOptions
from common.cli_args import parse_config
from common.config import EngineAddresses, TandemConfig
from common.ipc import make_runtime_dir
from common.messages import EngineRequest, SamplingParams
from common.model_files import resolve_model_dir
from common.process import small_thread_env, start_module, stop_process

T = TypeVar("T")

__all__ = ["LLM", "CompletionOutput", "GenerationResult", "SamplingParams"]


@dataclass(frozen=True)
class CompletionOutput:
    """One generated continuation."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"


@dataclass(frozen=True)
class GenerationResult:
    """A prompt and what was generated for it (vLLM calls this ``RequestOutput``)."""

    prompt: str | list[int]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


def _flags(model: str, options: dict[str, Any]) -> list[str]:
    """Keyword options as ``tandem serve`` flags: ``max_model_len=512`` ->
    ``--max-model-len 512``; booleans as ``--x`` / ``--no-x``."""
    argv = ["--model", model]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return argv


class LLM:
    """A private engine for one Python process. Options are ``tandem serve``'s flags as
    keywords (``dtype="float32"``, ``max_num_seqs=32``, ...)."""

    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        *,
        startup_timeout_s: float = 600.0,
        **options: Any,
    ) -> None:
        from transformers import AutoTokenizer

        config = parse_config(_flags(model, options), prog="LLM")
        served_name = config.served_model_name
        model_dir = resolve_model_dir(config.model.model)
        self._runtime_dir = make_runtime_dir()
        self.config: TandemConfig = config.with_model_path(
            str(model_dir), served_name
        ).with_addresses(EngineAddresses.ipc_in(self._runtime_dir))
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tandem-llm", daemon=True
        )
        self._thread.start()
        self._engine: subprocess.Popen[bytes] | None = start_module(
            "engine_core", self.config.to_cli_args(), env=small_thread_env()
        )
        self._client = EngineClient(self.config.addresses)
        try:
            self._call(self._client.start())
            self._service = CompletionService(served_name, self.tokenizer, self._client)
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._client.ready:
            if self._engine is not None and self._engine.poll() is not None:
                raise RuntimeError(f"the engine core exited with code {self._engine.returncode}")
            if self._client.is_dead:
                raise RuntimeError(str(self._client.dead_reason))
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine was not ready within {timeout_s:.0f} s")
            time.sleep(0.05)

    @property
    def engine_pid(self) -> int:
        """The engine core's pid (its workers are its children), e.g. to sample memory."""
        if self._engine is None:
            raise RuntimeError("this LLM is closed")
        return self._engine.pid

    @property
    def max_model_len(self) -> int:
        assert self._client.model is not None  # set before ready
        return self._client.model.max_model_len

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | None = None,
        stop: Sequence[str] = (),
    ) -> list[GenerationResult]:
        """Generate for every prompt (text, or token ids) at once; results in prompt
        order. ``stop`` strings end a completion early and are not included in it."""
        if self._engine is None:
            raise RuntimeError("this LLM is closed")
        batch: list[str | list[int]]
        if isinstance(prompts, str):
            batch = [prompts]
        elif prompts and all(isinstance(t, int) for t in prompts):
            batch = [[int(t) for t in prompts]]  # type: ignore[arg-type]  # one list of ids
        else:
            batch = list(prompts)  # type: ignore[arg-type]  # several prompts
        params = params or SamplingParams()
        requests = [self._request(p, params) for p in batch]
        outputs = self._call(self._run_all(requests, list(stop)))
        return [
            GenerationResult(p, r.prompt_token_ids, [o])
            for p, r, o in zip(batch, requests, outputs, strict=True)
        ]

    def _request(self, prompt: str | list[int], params: SamplingParams) -> EngineRequest:
        """The server's own checks (empty prompt, vocabulary, context length), raised
        as ``ValueError`` instead of an HTTP error."""
        try:
            info = self._service.model_info()
            ids = self._service.tokenize(prompt, info)
            self._service.completion_budget(len(ids), params.max_tokens, info)
        except ApiError as e:
            raise ValueError(e.message) from None
        return EngineRequest(
            request_id=f"llm-{next(self._ids)}",
            client_id=self._client.client_id,
            prompt_token_ids=ids,
            sampling_params=params,
            arrival_time=time.time(),
        )

    async def _run_all(
        self, requests: list[EngineRequest], stop: list[str]
    ) -> list[CompletionOutput]:
        return list(await asyncio.gather(*(self._run_one(r, stop) for r in requests)))

    async def _run_one(self, request: EngineRequest, stop: list[str]) -> CompletionOutput:
        pieces: list[Piece] = []
        try:
            async for piece in self._service.run(request, TextOptions(stop)):
                pieces.append(piece)
        except EngineRequestError as e:
            raise RuntimeError(f"request {request.request_id} failed: {e}") from None
        finish = pieces[-1].finish_reason if pieces else None
        return CompletionOutput(
            "".join(p.text for p in pieces),
            [t for p in pieces for t in p.token_ids],
            finish or "length",
        )

    def close(self) -> None:
        """Stop the engine core and its workers; idempotent."""
        if self._loop.is_running():
            with contextlib.suppress(Exception):
                self._call(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if self._engine is not None:
            stop_process(self._engine)
            self._engine = None
        shutil.rmtree(self._runtime_dir, ignore_errors=True)

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_engine", None) is not None:
            self.close()
