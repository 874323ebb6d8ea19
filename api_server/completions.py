"""``POST /v1/completions``: one or several prompts, ``n`` choices each, streamed or not.

Each choice is its own engine request (``<id>`` for the first, ``<id>-<k>`` after), so
the scheduler batches them like any others; streams of several choices are merged as
their pieces arrive, each chunk naming its choice ``index``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from api_server.generation import (
    ApiError,
    CompletionService,
    EngineRequestError,
    Piece,
    collect,
    completion_logprobs,
)
from api_server.http_util import caller_of, first_piece, parse, sse
from api_server.protocol import CompletionRequest, completion_chunk, error_body, now, usage

logger = logging.getLogger(__name__)


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    echo_text: str
    pieces: AsyncGenerator[Piece, None]
    first: Piece | None = None
    text_offset: int = 0
    collected: list[Piece] = field(default_factory=list)


class CompletionsRoute:
    def __init__(self, service: CompletionService, max_choices: int) -> None:
        self.service = service
        self.max_choices = max_choices

    async def handle(self, request: Request) -> Response:
        service = self.service
        req = await parse(request, CompletionRequest, service.served_model_name)
        prompts = req.prompts()
        if len(prompts) * req.n > self.max_choices:
            raise ApiError(
                422,
                f"'n' times the number of prompts is {len(prompts) * req.n}; at most "
                f"{self.max_choices} choices per request",
                param="n",
            )
        if req.echo and req.logprobs is not None:
            raise ApiError(422, "'echo' together with 'logprobs' is not supported", param="echo")
        info = service.model_info()
        ids = [service.tokenize(p, info) for p in prompts]
        base = f"cmpl-{uuid.uuid4().hex}"
        choices: list[Choice] = []
        for i, prompt_ids in enumerate(ids):
            echo = (
                (
                    prompts[i]
                    if isinstance(prompts[i], str)
                    else service.tokenizer.decode(prompt_ids)
                )
                if req.echo
                else ""
            )
            for j in range(req.n):
                k = len(choices)
                _, pieces = service.start(
                    req,
                    prompt_ids,
                    info,
                    "completion",
                    base if k == 0 else f"{base}-{k}",
                    j,
                    caller_of(request),
                )
                choices.append(Choice(k, prompt_ids, str(echo), pieces))
        try:
            # A refusal (queue full, engine down) becomes an HTTP status, not a stream error.
            firsts = await asyncio.gather(*(first_piece(c.pieces) for c in choices))
        except BaseException:
            for c in choices:
                await c.pieces.aclose()
            raise
        for c, first in zip(choices, firsts, strict=True):
            c.first = first
        headers = {"X-Request-Id": base}
        num_prompt = sum(len(p) for p in ids)
        if req.stream:
            return StreamingResponse(
                self._stream(choices, base, num_prompt, req.return_token_ids),
                media_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache"},
            )
        for c in choices:
            assert c.first is not None
            c.collected = await collect(c.first, c.pieces)
        return JSONResponse(
            self._body(choices, base, num_prompt, req.return_token_ids), headers=headers
        )

    def _body(
        self, choices: list[Choice], request_id: str, num_prompt: int, with_ids: bool
    ) -> dict[str, Any]:
        out = []
        for c in choices:
            token_ids = [t for p in c.collected for t in p.token_ids]
            lps = completion_logprobs(
                self.service.tokenizer, token_ids, [lp for p in c.collected for lp in p.logprobs], 0
            )
            choice: dict[str, Any] = {
                "index": c.index,
                "text": c.echo_text + "".join(p.text for p in c.collected),
                "logprobs": lps,
                "finish_reason": c.collected[-1].finish_reason,
            }
            if with_ids:
                choice["token_ids"] = token_ids
                choice["prompt_token_ids"] = c.prompt_ids
            out.append(choice)
        completion_tokens = sum(c.collected[-1].num_completion_tokens for c in choices)
        cached = sum(c.collected[-1].num_cached_tokens for c in choices)
        logger.info(
            "[%s] finished: %s", request_id, ", ".join(str(c["finish_reason"]) for c in out)
        )
        body: dict[str, Any] = {
            "id": request_id,
            "object": "text_completion",
            "created": now(),
            "model": self.service.served_model_name,
            "choices": out,
            "usage": usage(num_prompt, completion_tokens, cached),
        }
        if with_ids and len(choices) == 1:
            body["prompt_token_ids"] = choices[0].prompt_ids  # vLLM's place for one prompt
        return body

    async def _stream(
        self, choices: list[Choice], request_id: str, num_prompt: int, with_ids: bool
    ) -> AsyncGenerator[str, None]:
        created, model = now(), self.service.served_model_name
        queue: asyncio.Queue[tuple[Choice, Piece | None, EngineRequestError | None]] = (
            asyncio.Queue()
        )

        async def pump(c: Choice) -> None:
            assert c.first is not None
            try:
                await queue.put((c, c.first, None))
                async for piece in c.pieces:
                    await queue.put((c, piece, None))
            except EngineRequestError as e:
                await queue.put((c, None, e))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        done: dict[int, Piece] = {}
        failed = False
        try:
            while len(done) < len(choices) and not failed:
                c, piece, error = await queue.get()
                if error is not None or piece is None:
                    logger.error("[%s] failed: %s", request_id, error)
                    yield sse(error_body(str(error), "server_error"))
                    failed = True
                    break
                prefix = c.echo_text if c.text_offset == 0 and piece is c.first else ""
                lps = completion_logprobs(
                    self.service.tokenizer, piece.token_ids, piece.logprobs, c.text_offset
                )
                c.text_offset += len(prefix) + len(piece.text)
                if piece.finish_reason:
                    done[c.index] = piece
                last_usage = None
                if len(done) == len(choices):
                    completion_tokens = sum(p.num_completion_tokens for p in done.values())
                    cached = sum(p.num_cached_tokens for p in done.values())
                    last_usage = usage(num_prompt, completion_tokens, cached)
                chunk = completion_chunk(
                    request_id,
                    model,
                    created,
                    prefix + piece.text,
                    piece.finish_reason,
                    last_usage,
                    piece.token_ids if with_ids else None,
                    lps,
                )
                chunk["choices"][0]["index"] = c.index
                yield sse(chunk)
            if not failed:
                logger.info(
                    "[%s] finished: %s",
                    request_id,
                    ", ".join(str(done[i].finish_reason) for i in sorted(done)),
                )
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in choices:
                await c.pieces.aclose()
        yield sse("[DONE]")
