"""The generation pipeline's output end with a content guard, driven without a server: a
fake engine replays outputs of a word-level tokenizer through ``CompletionService.run``.
A stop string kept in the output is screened like any text; token ids and logprobs go
out only with text that was let through; a token-id prompt is decoded only for a guard
that reads prompts (or ``echo``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any, cast

import pytest
from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel

from api_server.blocklist import Blocklist, parse_blocklist
from api_server.completions import CompletionFormat
from api_server.content_guard import ContentGuard, NoContentGuard
from api_server.generation import CompletionService, HeldTokens, Piece, TextOptions
from api_server.protocol import CompletionRequest
from common.messages import (
    EngineRequest,
    FinishReason,
    ModelInfo,
    RequestOutput,
    SamplingParams,
    SchedulerStats,
    TokenLogprobs,
)

VOCAB = ["[UNK]", "foo ", "bar", " baz", "The capital is", " Par", "is", "ian", "."]
ID = {token: i for i, token in enumerate(VOCAB)}


def word_tokenizer() -> Tokenizer:
    """Each token's text is its vocabulary entry, joined as written."""
    tokenizer = Tokenizer(WordLevel(ID, unk_token="[UNK]"))
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def logprob(token: str) -> TokenLogprobs:
    return TokenLogprobs(-float(ID[token]), [ID[token]], [-0.5])  # which token, by its value


class FakeEngine:
    """What ``CompletionService`` reads of an ``EngineClient``: ``generate`` replays the
    outputs given, one per step; ``left_early`` says whether the pipeline aborted it."""

    client_id = b"test"
    stats = SchedulerStats()
    pools: dict[str, SchedulerStats] = {}
    kv_transfers = None

    def __init__(self, steps: list[list[str]]) -> None:
        self.steps = steps
        self.left_early = False

    async def generate(
        self, request: EngineRequest, owner: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        for n, step in enumerate(self.steps, start=1):
            last = n == len(self.steps)
            try:
                yield RequestOutput(
                    request.request_id,
                    [ID[t] for t in step],
                    FinishReason.LENGTH if last else None,
                    logprobs=[logprob(t) for t in step],
                )
            except GeneratorExit:
                self.left_early = not last
                raise


def service(guard: ContentGuard, engine: Any = None) -> CompletionService:
    tokenizer = SimpleNamespace(backend_tokenizer=word_tokenizer())
    return CompletionService("m", tokenizer, cast(Any, engine or FakeEngine([])), guard=guard)


def generate(guard: ContentGuard, steps: list[list[str]], **options: Any) -> list[Piece]:
    engine = FakeEngine(steps)
    request = EngineRequest("cmpl-1", b"test", [1], SamplingParams(), time.time())

    async def pieces() -> list[Piece]:
        return [p async for p in service(guard, engine).run(request, TextOptions(**options))]

    return asyncio.run(pieces())


def blocklist(*words: str) -> Blocklist:
    return Blocklist(parse_blocklist("\n".join(words) + "\n"))


def shown(pieces: list[Piece]) -> list[tuple[str, list[str], list[str], str | None]]:
    """Each piece's text, tokens, the tokens its logprobs are of, and finish reason."""
    return [
        (
            p.text,
            [VOCAB[t] for t in p.token_ids],
            [VOCAB[lp.top_token_ids[0]] for lp in p.logprobs],
            p.finish_reason,
        )
        for p in pieces
    ]


def test_a_stop_string_kept_in_the_output_is_screened() -> None:
    steps = [["foo "], ["bar"], [" baz"]]
    kept = generate(blocklist("bar"), steps, stop_strings=["bar"], include_stop_str_in_output=True)
    assert shown(kept) == [("foo ", ["foo "], ["foo "], None), ("", [], [], "content_filter")]
    assert kept[-1].stop_string is None and kept[-1].num_completion_tokens == 2
    # Left out, the stop string is no output: the stop ends it, its token counted as ever.
    cut = generate(blocklist("bar"), steps, stop_strings=["bar"])
    assert shown(cut) == [("foo ", ["foo "], ["foo "], None), ("", ["bar"], ["bar"], "stop")]
    assert cut[-1].stop_string == "bar"
    # A kept stop string the guard lets through ends the output as a stop string.
    clean = generate(
        blocklist("paris"), steps, stop_strings=["bar"], include_stop_str_in_output=True
    )
    assert shown(clean) == [("foo ", ["foo "], ["foo "], None), ("bar", ["bar"], ["bar"], "stop")]


def test_ids_and_logprobs_stop_where_the_text_is_cut() -> None:
    steps = [["The capital is"], [" Par"], ["is"], ["."], ["foo "]]
    engine = FakeEngine(steps)
    request = EngineRequest("cmpl-1", b"test", [1], SamplingParams(), time.time())

    async def pieces() -> list[Piece]:
        return [p async for p in service(blocklist("paris"), engine).run(request)]

    cut = asyncio.run(pieces())
    # " Par" lets its space through but not its token; "Paris" is held, then blocked.
    assert shown(cut) == [
        ("The capital is", ["The capital is"], ["The capital is"], None),
        (" ", [], [], None),
        ("", [], [], "content_filter"),
    ]
    assert cut[-1].num_completion_tokens == 4  # generated, and charged, all the same
    assert engine.left_early  # aborted in the engine
    # A speculative step bringing them all at once is cut the same way.
    at_once = generate(blocklist("paris"), [["The capital is", " Par", "is", ".", "foo "]])
    assert shown(at_once) == [
        ("The capital is ", ["The capital is"], ["The capital is"], "content_filter")
    ]


def test_held_tokens_go_out_with_their_text_when_it_is_no_word_after_all() -> None:
    pieces = generate(blocklist("paris"), [["The capital is"], [" Par"], ["is"], ["ian"]])
    assert shown(pieces) == [
        ("The capital is", ["The capital is"], ["The capital is"], None),
        (" ", [], [], None),
        ("Parisian", [" Par", "is", "ian"], [" Par", "is", "ian"], "length"),
    ]


def test_a_token_without_text_of_its_own_goes_with_the_next() -> None:
    held = HeldTokens()
    held.add(1, None, "ab")
    held.add(2, None, "")  # e.g. the first bytes of a character
    held.add(3, None, "cd")
    assert held.take(2) == ([1], [])
    assert held.take(3) == ([], [])  # token 3's text is not all sent
    assert held.take(4) == ([2, 3], [])
    held.add(4, None, "e")
    assert held.take_all() == ([4], [])


class CountingTokenizer:
    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids: list[int]) -> str:
        self.decoded += 1
        return "I love Paris"


@pytest.mark.parametrize(
    ("guard", "echo", "decoded", "refused"),
    [
        (NoContentGuard(), False, 0, False),
        (NoContentGuard(), True, 1, False),
        (blocklist("paris"), False, 1, True),
    ],
)
def test_a_token_id_prompt_is_decoded_only_when_something_reads_it(
    guard: ContentGuard, echo: bool, decoded: int, refused: bool
) -> None:
    tokenizer = CountingTokenizer()
    completions = service(guard)
    completions.tokenizer = tokenizer
    request = CompletionRequest.model_validate(
        {"model": "m", "prompt": [5, 6, 7], "echo": echo, "max_tokens": 1}
    )
    [prompt] = CompletionFormat(completions).prompts(request, ModelInfo(64, 100, [0]))
    assert tokenizer.decoded == decoded
    assert prompt.text == ("I love Paris" if decoded else "")
    assert (guard.check(prompt.text) is not None) == refused
