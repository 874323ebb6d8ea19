"""One driver runs a generation for every API flavour; a small format object per
flavour (``completions.py``, ``chat.py``, ``anthropic_api.py``) turns its pieces into
chunks, final bodies and errors.

The driver owns what the three used to repeat: parsing and the model-name check, the
ignored-fields report, refusing parameters that cannot be honoured and prompts the
content guard refuses (``CompletionService.screen_prompt``), one engine request per
choice (``<id>`` for the first, ``<id>-<k>`` after, so cancel-by-id reaches them all),
waiting for each choice's first piece (a refusal is an HTTP status, not an error
inside a stream), merging streamed choices as their pieces arrive, mid-stream errors,
and the response headers (``X-Request-Id``, ``Cache-Control``, ``Retry-After`` through
``error_response``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from api_server.audit_middleware import audit_of
from api_server.errors import ApiError, ErrorFormat, error_response
from api_server.generation import (
    CompletionService,
    EngineRequestError,
    Piece,
    collect,
)
from api_server.generation_state import Choice, Generation, Prompt
from api_server.http_util import caller_of, first_piece, json_body, key_id_of, tenant_of
from api_server.kv_transfer_params import parse_kv_transfer_params
from api_server.protocol import GenerationRequest
from common.messages import ModelInfo

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "X-Tandem-Ignored-Fields"
MAX_REPORTED_FIELDS = 32  # names beyond this are counted, not listed


@dataclass(frozen=True)
class Parsed:
    """A request body in the engine's terms, and the fields it carried without effect."""

    request: GenerationRequest
    unknown: list[str]  # no schema declares them
    ignored: list[str]  # unknown ones, and known ones that do not apply here


class ApiFormat(Protocol):
    """What one API flavour decides; the driver does the rest."""

    name: str  # for logs: completion, chat, messages
    id_prefix: str  # cmpl-, chatcmpl-, msg_
    errors: ErrorFormat

    def parse(self, body: dict[str, Any], owner: str | None) -> Parsed:
        """The body as a generation request (ApiError on invalid fields); ``owner`` is the
        caller's API key (what a stored earlier response is looked up under)."""
        ...

    def prompts(self, request: GenerationRequest, info: ModelInfo) -> list[Prompt]:
        """Token ids of each prompt (each gets ``n`` choices)."""
        ...

    def stream_start(self, gen: Generation) -> list[str]: ...

    def stream_piece(self, gen: Generation, choice: Choice, piece: Piece) -> list[str]:
        """Events for a piece already appended to ``choice.collected``."""
        ...

    def stream_end(self, gen: Generation) -> list[str]: ...

    def stream_error(self, gen: Generation, message: str) -> list[str]: ...

    def body(self, gen: Generation) -> dict[str, Any]: ...


_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def client_request_id(request: Request) -> str | None:
    """A client's own request id (``X-Request-Id``, as vLLM takes it): it names the
    request in the engine and in cancel, and may be reused once that request has ended."""
    given = request.headers.get("x-request-id")
    if given is None:
        return None
    if not _CLIENT_ID.fullmatch(given):
        raise ApiError(
            400,
            "X-Request-Id must be 1-128 letters, digits or . _ : -",
            param="X-Request-Id",
        )
    return given


class GenerationDriver:
    def __init__(
        self,
        service: CompletionService,
        fmt: ApiFormat,
        max_choices: int,
        strict_fields: bool = False,
    ) -> None:
        self.service = service
        self.format = fmt
        self.max_choices = max_choices
        self.strict_fields = strict_fields

    async def handle(self, request: Request) -> Response:
        try:
            return await self._handle(request)
        except ApiError as e:
            return error_response(e, self.format.errors)

    def _check_fields(self, parsed: Parsed) -> dict[str, str]:
        if parsed.unknown and self.strict_fields:
            name = parsed.unknown[0]
            raise ApiError(422, f"'{name}' is not supported", param=name)
        if not parsed.ignored:
            return {}
        names = [quote(name, safe="._-") for name in parsed.ignored[:MAX_REPORTED_FIELDS]]
        if len(parsed.ignored) > MAX_REPORTED_FIELDS:
            names.append(f"...{len(parsed.ignored) - MAX_REPORTED_FIELDS}-more")
        logger.warning(
            "%s request: ignored fields without effect here: %s", self.format.name, ",".join(names)
        )
        # Percent-encoded: a header is ASCII, field names need not be.
        return {IGNORED_FIELDS_HEADER: ",".join(names)}

    async def render(self, request: Request) -> Response:
        """``POST <route>/render``: the prompt token ids the request would be served with
        (template applied), generating nothing. vLLM's router asks every instance for
        them to match a request's prefix against the instances' KV events."""
        try:
            req = self.format.parse(await json_body(request), key_id_of(request)).request
            self.service.resolve_model(req.model)
            prompts = self.format.prompts(req, self.service.model_info())
        except ApiError as e:
            return error_response(e, self.format.errors)
        rendered = [{"token_ids": p.ids, "num_tokens": len(p.ids)} for p in prompts]
        return JSONResponse(rendered[0] if len(rendered) == 1 else rendered)

    async def _handle(self, request: Request) -> Response:
        service, fmt = self.service, self.format
        parsed = fmt.parse(await json_body(request), key_id_of(request))
        req = parsed.request
        audit = audit_of(request)  # read when the request ends (audit_middleware.py)
        audit.model = req.model
        lora = service.resolve_model(req.model)
        headers = self._check_fields(parsed)
        req.refuse_unsupported()
        info = service.model_info()
        prompts = fmt.prompts(req, info)
        if len(prompts) * req.n > self.max_choices:
            raise ApiError(
                422,
                f"'n' times the number of prompts is {len(prompts) * req.n}; at most "
                f"{self.max_choices} choices per request",
                param="n",
            )
        kv_transfer = parse_kv_transfer_params(
            req.kv_transfer_params, len(prompts) * req.n, req.stream
        )
        if kv_transfer is not None and req.num_prompt_logprobs() is not None:
            raise ApiError(
                400,
                "prompt logprobs come from a prefill here: not with 'kv_transfer_params'",
                param="prompt_logprobs",
            )
        request_id = client_request_id(request) or f"{fmt.id_prefix}{uuid.uuid4().hex}"
        for prompt in prompts:
            service.screen_prompt(prompt.text, request_id)
        model = service.served_model_name if lora is None else lora.name
        gen = Generation(request_id, model, int(time.time()), req, [])
        audit.generation = gen
        for prompt in prompts:
            for j in range(req.n):
                k = len(gen.choices)
                _, pieces = service.start(
                    req,
                    prompt.ids,
                    info,
                    fmt.name,
                    request_id if k == 0 else f"{request_id}-{k}",
                    j,
                    caller_of(request),
                    key_id_of(request),
                    kv_transfer,
                    prompt.rules,
                    lora,
                    tenant_of(request),
                )
                gen.choices.append(Choice(k, prompt, pieces))
        try:
            firsts = await asyncio.gather(*(first_piece(c.pieces) for c in gen.choices))
        except BaseException:
            for c in gen.choices:
                await c.pieces.aclose()
            raise
        headers["X-Request-Id"] = request_id
        if req.stream:
            return StreamingResponse(
                self._stream(gen, firsts),
                media_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache"},
            )
        for c, first in zip(gen.choices, firsts, strict=True):
            c.collected = await collect(first, c.pieces)
        self._log_finished(gen)
        body = fmt.body(gen)
        lent = gen.choices[0].last.kv_transfer_params if gen.choices[0].last else None
        if lent is not None:  # a prefill for a remote decode: where its KV waits
            body["kv_transfer_params"] = msgspec.to_builtins(lent)
        return JSONResponse(body, headers=headers)

    async def _stream(self, gen: Generation, firsts: list[Piece]) -> AsyncGenerator[str, None]:
        fmt = self.format
        queue: asyncio.Queue[tuple[Choice, Piece | None, str | None]] = asyncio.Queue()

        async def pump(choice: Choice, first: Piece) -> None:
            try:
                await queue.put((choice, first, None))
                async for piece in choice.pieces:
                    await queue.put((choice, piece, None))
            except EngineRequestError as e:
                await queue.put((choice, None, str(e)))

        tasks = [asyncio.create_task(pump(c, f)) for c, f in zip(gen.choices, firsts, strict=True)]
        num_done = 0
        try:
            for event in fmt.stream_start(gen):
                yield event
            while num_done < len(gen.choices):
                choice, piece, error = await queue.get()
                if piece is None:
                    logger.error("[%s] failed: %s", gen.request_id, error)
                    for event in fmt.stream_error(gen, error or "the engine failed this request"):
                        yield event
                    return
                choice.collected.append(piece)
                num_done += piece.finish_reason is not None
                for event in fmt.stream_piece(gen, choice, piece):
                    yield event
            self._log_finished(gen)
            for event in fmt.stream_end(gen):
                yield event
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in gen.choices:
                await c.pieces.aclose()

    def _log_finished(self, gen: Generation) -> None:
        logger.info(
            "[%s] finished: %s (%d tokens)",
            gen.request_id,
            ", ".join(str(c.last.finish_reason if c.last else None) for c in gen.choices),
            sum(c.num_completion_tokens for c in gen.choices),
        )
