"""The generation pipeline shared by every route: validate against the model, tokenize,
screen prompts, send to the engine, detokenize incrementally and apply stop strings and
the content guard, as ``Piece``s."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec

from api_server.client import EngineClient
from api_server.content_guard import ContentGuard, NoContentGuard
from api_server.detokenizer import IncrementalDetokenizer, StopStringMatcher
from api_server.errors import ApiError
from api_server.metrics import Metrics
from api_server.oidc import tenant_cache_salt
from api_server.protocol import GenerationRequest, SamplingDefaults, finish_reason_text
from api_server.rate_limit import RateLimiter
from common.messages import (
    EngineRequest,
    ErrorKind,
    FinishReason,
    KVTransferParams,
    LoRARequest,
    ModelInfo,
    StructuredOutput,
    TokenLogprobs,
)
from common.tracing import trace_headers

logger = logging.getLogger(__name__)


class EngineRequestError(Exception):
    """The engine refused or failed a request."""

    def __init__(self, message: str, kind: ErrorKind | None, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.param = param

    def api_error(self) -> ApiError:
        if self.kind == ErrorKind.INVALID:
            return ApiError(400, str(self), param=self.param)
        if self.kind == ErrorKind.OVERLOADED:
            return ApiError(503, str(self), "server_error", code="queue_full")
        return ApiError(503, str(self), "server_error")


@dataclass(frozen=True)
class TextOptions:
    """How engine tokens become a request's text: stop strings (and whether the matched
    one stays in the text, vLLM's ``include_stop_str_in_output``), special tokens."""

    stop_strings: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stops_end_at: str | None = None  # OutputRules.stops_end_at


@dataclass(frozen=True)
class OutputRules:
    """What a route adds to a request's own output settings: the grammar its output
    follows (a tool call's, in place of the request's structured output), and the text
    after which its stop strings no longer apply (a call's trigger: a stop string must
    never cut a call; "" = they never apply)."""

    grammar: StructuredOutput | None = None
    stops_end_at: str | None = None


@dataclass(frozen=True)
class Piece:
    """Text produced by one engine output, and the finish reason on the last one."""

    text: str
    finish_reason: str | None
    num_completion_tokens: int
    token_ids: list[int]
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprobs]  # one per token id, when the request asked
    stop_string: str | None = None  # set on the last piece when a stop string ended it
    # On the last piece of a request prefilled for a remote decode: where its KV waits.
    kv_transfer_params: KVTransferParams | None = None
    # On the first piece, when asked: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None


class HeldTokens:
    """An output's token ids and logprobs waiting for their text: each goes out with the
    piece that carries the end of its text (one with no text of its own, with the next
    token's), so a piece never shows a token whose text was held back or cut off."""

    def __init__(self) -> None:
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprobs] = []
        self._ends: list[int] = []  # where each token's text ends in the output's text
        self._num_chars = 0  # the output's text so far, as the detokenizer wrote it
        self._num_taken = 0  # where the text of the last token taken ends

    def add(self, token_id: int, logprobs: TokenLogprobs | None, text: str) -> None:
        self._ids.append(token_id)
        if logprobs is not None:
            self._logprobs.append(logprobs)
        self._num_chars += len(text)
        self._ends.append(self._num_chars)

    def take(self, num_sent: int) -> tuple[list[int], list[TokenLogprobs]]:
        """The tokens whose text lies within the first ``num_sent`` characters sent."""
        n, start = 0, self._num_taken
        for i, end in enumerate(self._ends):
            if end > num_sent:
                break
            if end > start:
                n, self._num_taken = i + 1, end
            start = end
        return self._split(n)

    def take_all(self) -> tuple[list[int], list[TokenLogprobs]]:
        """Every token: the output ended and the guard cut nothing (text past a stop
        string is cut, but its tokens were generated and count)."""
        return self._split(len(self._ids))

    def _split(self, n: int) -> tuple[list[int], list[TokenLogprobs]]:
        ids, self._ids = self._ids[:n], self._ids[n:]
        logprobs, self._logprobs = self._logprobs[:n], self._logprobs[n:]
        del self._ends[:n]
        return ids, logprobs


class CompletionService:
    """Everything the routes share: the tokenizer, the engine client, the model name, the
    model's sampling defaults, the token rate limiter, the metrics, the content guard.
    Prompts and outputs reach the log only with ``log_requests``."""

    def __init__(
        self,
        served_model_name: str,
        tokenizer: Any,
        client: EngineClient,
        limiter: RateLimiter | None = None,
        log_requests: bool = False,
        metrics: Metrics | None = None,
        sampling_defaults: SamplingDefaults | None = None,
        guard: ContentGuard | None = None,
    ) -> None:
        self.served_model_name = served_model_name
        self.tokenizer = tokenizer
        self.client = client
        self.metrics = metrics or Metrics(served_model_name, client)
        self.limiter = limiter or RateLimiter()
        self.log_requests = log_requests
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        self.guard = guard or NoContentGuard()
        self.draining = False  # set on SIGTERM: new requests get 503, running ones finish

    def resolve_model(self, model: str) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for a
        name this server does not serve."""
        if model == self.served_model_name:
            return None
        adapter = self.client.lora_adapters.get(model)
        if adapter is None:
            names = ", ".join(
                f"'{n}'" for n in [self.served_model_name, *self.client.lora_adapters]
            )
            raise ApiError(
                404,
                f"model '{model}' does not exist; this server serves {names}",
                "not_found_error",
                "model",
                "model_not_found",
            )
        return adapter

    def model_info(self) -> ModelInfo:
        """The model's figures, or 503 when this server cannot take a request now."""
        if self.draining:
            raise ApiError(
                503, "the server is shutting down; retry on another replica", "server_error"
            )
        if self.client.is_dead:
            raise ApiError(503, f"the engine is down: {self.client.dead_reason}", "server_error")
        if not self.client.ready or self.client.model is None:
            raise ApiError(503, "the model is still loading; retry shortly", "server_error")
        return self.client.model

    def tokenize(
        self, prompt: str | list[int], info: ModelInfo, add_special_tokens: bool = True
    ) -> list[int]:
        ids: list[int] = (
            self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            if isinstance(prompt, str)
            else list(prompt)
        )
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise ApiError(
                400,
                f"token id {bad} is outside the vocabulary (size {info.vocab_size})",
                param="prompt",
            )
        return ids

    def screen_prompt(self, text: str, request_id: str) -> None:
        """400 (code ``content_filter``) for a prompt text the content guard refuses; the
        client is not told what matched, the log names the rule."""
        hit = self.guard.check(text)
        if hit is None:
            return
        self.metrics.guardrail_hit("prompt")
        logger.info("[%s] prompt refused by the content guard (%s)", request_id, hit.rule)
        raise ApiError(
            400,
            "the prompt contains text this server's content filter blocks; rephrase it",
            code="content_filter",
        )

    @staticmethod
    def completion_budget(num_prompt: int, max_tokens: int | None, info: ModelInfo) -> int:
        limit = info.max_model_len
        if num_prompt >= limit:
            raise ApiError(
                400,
                f"the prompt has {num_prompt} tokens; this model's context length is {limit} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise ApiError(
                400,
                f"this model's context length is {limit} tokens, but {num_prompt + max_tokens} were "
                f"requested ({num_prompt} in the prompt, {max_tokens} for the completion)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def start(
        self,
        req: GenerationRequest,
        prompt_ids: list[int],
        info: ModelInfo,
        kind: str,
        request_id: str | None = None,
        choice: int = 0,
        caller: str = "",
        owner: str | None = None,
        kv_transfer: KVTransferParams | None = None,
        rules: OutputRules | None = None,
        lora: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> tuple[str, AsyncGenerator[Piece, None]]:
        """Budget the completion, send the request, and return its id and its pieces.
        Choice ``k`` of a request with several gets seed ``seed + k`` so choices differ.
        ``caller`` is charged the prompt's tokens now and the completion's when it ends;
        ``owner`` (the API key's or OIDC tenant's identity, with sign-in on) alone may
        cancel it; an OIDC ``tenant``'s prefix-cache entries are its own."""
        max_tokens = self.completion_budget(len(prompt_ids), req.requested_max_tokens(), info)
        req.check_token_ids(info.vocab_size)
        if req.min_tokens > max_tokens:
            raise ApiError(
                422,
                f"'min_tokens' ({req.min_tokens}) exceeds max_tokens ({max_tokens})",
                param="min_tokens",
            )
        request_id = request_id or f"{kind}-{uuid.uuid4().hex}"
        rules = rules or OutputRules()
        params = req.sampling_params(max_tokens, self.sampling_defaults)
        if rules.grammar is not None:
            params = msgspec.structs.replace(params, structured=rules.grammar)
        if params.seed is not None and choice:
            params = msgspec.structs.replace(params, seed=(params.seed + choice) % 2**63)
        engine_request = EngineRequest(
            request_id=request_id,
            client_id=self.client.client_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            arrival_time=time.time(),
            priority=req.priority,
            cache_salt=tenant_cache_salt(tenant, req.cache_salt),
            owner=owner,
            kv_transfer=kv_transfer,
            lora=lora,
            trace_headers=trace_headers(),  # the request's span, when tracing is on
        )
        logger.info(
            "[%s] %s: %d prompt tokens, max_tokens=%d, stream=%s",
            request_id,
            kind,
            len(prompt_ids),
            max_tokens,
            req.stream,
        )
        if self.log_requests:
            logger.info(
                "[%s] prompt: %r (params %s)",
                request_id,
                self.tokenizer.decode(prompt_ids),
                msgspec.json.encode(params).decode(),
            )
        self.limiter.charge(caller, len(prompt_ids))
        if choice == 0:
            self.metrics.served_here.inc()
            if lora is not None:
                self.metrics.lora_requests.labels(self.served_model_name, lora.name).inc()
        text_options = TextOptions(
            req.stop_strings(),
            req.include_stop_str_in_output,
            req.skip_special_tokens,
            rules.stops_end_at,
        )
        return request_id, self.run(engine_request, text_options, caller, owner)

    async def run(
        self,
        request: EngineRequest,
        options: TextOptions | None = None,
        caller: str = "",
        owner: str | None = None,
    ) -> AsyncGenerator[Piece, None]:
        """Engine outputs -> text pieces; a stop string or a content-guard hit ends the
        request early."""
        num_tokens = 0
        texts: list[str] = []
        try:
            # aclosing: closing this generator must close the engine stream now (abort).
            pieces_of = self._pieces(request, options or TextOptions(), owner)
            async with aclosing(pieces_of) as pieces:
                async for piece in pieces:
                    num_tokens = piece.num_completion_tokens
                    if self.log_requests:
                        texts.append(piece.text)
                    yield piece
        finally:
            self.limiter.charge(caller, num_tokens)
            if self.log_requests:
                logger.info("[%s] output: %r", request.request_id, "".join(texts))

    async def _pieces(
        self, request: EngineRequest, options: TextOptions, owner: str | None
    ) -> AsyncGenerator[Piece, None]:
        detok = IncrementalDetokenizer(
            self.tokenizer.backend_tokenizer, options.skip_special_tokens
        )
        matcher = StopStringMatcher(options.stop_strings, options.stops_end_at)
        scan = self.guard.scan()  # after the stop strings: text past one is never output
        num_tokens = 0
        num_cached = 0
        held = HeldTokens()
        num_sent = 0  # characters sent, a prefix of the detokenizer's text
        prompt_logprobs: list[TokenLogprobs] | None = None  # until a piece carries them
        last_token_time: float | None = None
        # aclosing: leaving early (stop string, client gone) aborts it in the engine now.
        async with aclosing(self.client.generate(request, owner)) as outputs:
            async for out in outputs:
                if out.finish_reason == FinishReason.ERROR:
                    raise EngineRequestError(
                        out.error or "the engine failed this request",
                        out.error_kind,
                        out.error_param,
                    )
                if out.new_token_ids:  # timed on arrival, before the client reads it
                    now = time.time()
                    if last_token_time is None:
                        self.metrics.ttft.observe(now - request.arrival_time)
                    else:
                        self.metrics.itl.observe(now - last_token_time)
                    last_token_time = now
                num_cached = max(num_cached, out.num_cached_tokens)
                if out.prompt_logprobs is not None:
                    prompt_logprobs = out.prompt_logprobs
                # Token by token: a speculative step brings several, and a stop string
                # or a guard hit ends the output at the token that completes it.
                text, logprobs = "", out.logprobs or []
                for k, token in enumerate(out.new_token_ids):
                    token_text = detok.push([token])
                    held.add(token, logprobs[k] if k < len(logprobs) else None, token_text)
                    text += scan.push(matcher.push(token_text))
                    num_tokens += 1
                    if matcher.hit or scan.hit:
                        break
                finish = "stop" if matcher.hit else finish_reason_text(out.finish_reason)
                if finish is not None:  # the output's last text: nothing is held back now
                    last = matcher.flush()  # "" after a stop string, which the guard reads
                    if matcher.hit and options.include_stop_str_in_output:
                        last = matcher.matched or ""
                    text += scan.finish(last)
                if scan.hit:
                    finish = "content_filter"
                    self.metrics.guardrail_hit("completion")
                    logger.info(
                        "[%s] output ended by the content guard (%s)",
                        request.request_id,
                        scan.hit.rule,
                    )
                if finish is not None:
                    self.metrics.finished(finish, request.arrival_time, out.timings)
                if text or finish is not None:
                    num_sent += len(text)
                    if finish is not None and not scan.hit:
                        ids, id_logprobs = held.take_all()
                    else:  # a token goes with the end of its text: none cut off is shown
                        ids, id_logprobs = held.take(num_sent)
                    yield Piece(
                        text,
                        finish,
                        num_tokens,
                        ids,
                        num_cached,
                        id_logprobs,
                        matcher.matched if finish == "stop" else None,
                        out.kv_transfer_params,
                        prompt_logprobs,
                    )
                    prompt_logprobs = None
                if finish is not None:
                    return


async def collect(first: Piece, rest: AsyncGenerator[Piece, None]) -> list[Piece]:
    """Every piece of a non-streamed request; an engine failure midway is a 503."""
    pieces = [first]
    try:
        async with aclosing(rest):
            pieces += [piece async for piece in rest]
    except EngineRequestError as e:
        raise ApiError(503, str(e), "server_error") from None
    return pieces
