"""``POST /v1/completions``, OpenAI's ``text_completion`` format: one or several
prompts, ``n`` choices each, ``echo``, legacy ``logprobs``.

The ``GenerationDriver`` runs it; this object only says how prompts are read and how
pieces become ``text_completion`` chunks and bodies.
"""

from __future__ import annotations

from typing import Any

from api_server.driver import Choice, Generation, Parsed, Prompt
from api_server.errors import OPENAI_ERRORS, ErrorFormat, error_body
from api_server.generation import CompletionService, Piece
from api_server.http_util import sse, validate
from api_server.prompt_logprobs import echo_logprobs, joined, vllm_prompt_logprobs
from api_server.protocol import CompletionRequest, GenerationRequest, unknown_fields
from common.messages import ModelInfo, TokenLogprobs


def completion_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: list[TokenLogprobs], text_offset: int
) -> dict[str, Any] | None:
    """The legacy completions ``logprobs`` object for these tokens; ``text_offset``
    is where the first token's text starts in the whole completion."""
    if not logprobs:
        return None
    tokens = [tokenizer.decode([t]) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [
            {
                tokenizer.decode([t]): v
                for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
            }
            for lp in logprobs
        ],
        "text_offset": offsets,
    }


class CompletionFormat:
    name = "completion"
    id_prefix = "cmpl-"
    errors: ErrorFormat = OPENAI_ERRORS

    def __init__(self, service: CompletionService) -> None:
        self.service = service

    def parse(self, body: dict[str, Any], owner: str | None) -> Parsed:
        req = validate(body, CompletionRequest)
        return Parsed(req, unknown_fields(req), req.ignored_fields())

    def prompts(self, request: GenerationRequest, info: ModelInfo) -> list[Prompt]:
        assert isinstance(request, CompletionRequest)  # parse() made it
        prompts = []
        for prompt in request.prompts():
            ids = self.service.tokenize(prompt, info, request.add_special_tokens)
            if request.truncate_prompt_tokens is not None:
                ids = ids[-request.truncate_prompt_tokens :]
            if isinstance(prompt, str):
                text = prompt
            elif request.echo or self.service.guard.checks_prompts:
                text = self.service.tokenizer.decode(ids)
            else:
                text = ""  # token ids that nothing reads as text
            prompts.append(Prompt(ids, text if request.echo else "", text=text))
        return prompts

    def _chunk(
        self, gen: Generation, choice: dict[str, Any], usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": gen.request_id,
            "object": "text_completion",
            "created": gen.created,
            "model": gen.model,
            "choices": [choice],
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def stream_start(self, gen: Generation) -> list[str]:
        return []

    def stream_piece(self, gen: Generation, choice: Choice, piece: Piece) -> list[str]:
        req = gen.request
        assert isinstance(req, CompletionRequest)  # parse() made it
        first = len(choice.collected) == 1
        echo = choice.prompt.echo if first else ""
        tokenizer = self.service.tokenizer
        made = not req.scores_only  # max_tokens 0: the sampled token is not shown
        logprobs = (
            completion_logprobs(
                tokenizer, piece.token_ids, piece.logprobs, choice.text_offset + len(echo)
            )
            if made
            else None
        )
        if first and req.echo and req.logprobs is not None and piece.prompt_logprobs is not None:
            echoed = echo_logprobs(
                tokenizer, choice.prompt.ids, piece.prompt_logprobs, req.logprobs
            )
            logprobs = joined(echoed, logprobs)
        text = echo + (piece.text if made else "")
        choice.text_offset += len(text)
        body: dict[str, Any] = {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": piece.finish_reason,
        }
        if first and req.prompt_logprobs is not None and piece.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(
                tokenizer, choice.prompt.ids, piece.prompt_logprobs, req.prompt_logprobs
            )
        if gen.request.return_token_ids:
            body["token_ids"] = piece.token_ids if made else []
        options = gen.request.stream_options
        all_done = all(c.last is not None and c.last.finish_reason for c in gen.choices)
        continuous = options is not None and options.continuous_usage_stats
        usage = self._usage(gen) if all_done or continuous else None
        return [sse(self._chunk(gen, body, usage))]

    @staticmethod
    def _usage(gen: Generation) -> dict[str, Any]:
        """Usage, with no completion tokens where the request only scores its prompt."""
        usage = gen.usage()
        assert isinstance(gen.request, CompletionRequest)  # parse() made it
        if gen.request.scores_only:
            usage["total_tokens"] -= usage["completion_tokens"]
            usage["completion_tokens"] = 0
        return usage

    def stream_end(self, gen: Generation) -> list[str]:
        return [sse("[DONE]")]

    def stream_error(self, gen: Generation, message: str) -> list[str]:
        return [sse(error_body(message, "server_error")), sse("[DONE]")]

    def body(self, gen: Generation) -> dict[str, Any]:
        req = gen.request
        assert isinstance(req, CompletionRequest)  # parse() made it
        tokenizer = self.service.tokenizer
        made = not req.scores_only  # max_tokens 0: the sampled token is not shown
        choices = []
        for c in gen.choices:
            logprobs = (
                completion_logprobs(
                    tokenizer,
                    c.token_ids,
                    [lp for p in c.collected for lp in p.logprobs],
                    len(c.prompt.echo),
                )
                if made
                else None
            )
            prompt_lps = c.collected[0].prompt_logprobs if c.collected else None
            if req.echo and req.logprobs is not None and prompt_lps is not None:
                echoed = echo_logprobs(tokenizer, c.prompt.ids, prompt_lps, req.logprobs)
                logprobs = joined(echoed, logprobs)
            choice: dict[str, Any] = {
                "index": c.index,
                "text": c.prompt.echo + (c.text if made else ""),
                "logprobs": logprobs,
                "finish_reason": c.last.finish_reason if c.last else None,
            }
            if req.prompt_logprobs is not None and prompt_lps is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(
                    tokenizer, c.prompt.ids, prompt_lps, req.prompt_logprobs
                )
            if gen.request.return_token_ids:
                choice["token_ids"] = c.token_ids if made else []
                choice["prompt_token_ids"] = c.prompt.ids
            choices.append(choice)
        body: dict[str, Any] = {
            "id": gen.request_id,
            "object": "text_completion",
            "created": gen.created,
            "model": gen.model,
            "choices": choices,
            "usage": self._usage(gen),
        }
        if gen.request.return_token_ids and len(gen.choices) == 1:
            body["prompt_token_ids"] = gen.choices[0].prompt.ids  # vLLM's place for one prompt
        return body
