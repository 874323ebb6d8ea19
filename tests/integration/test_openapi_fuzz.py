"""Schemathesis against the server's own /openapi.json: generated bodies, valid and
invalid, never get a 5xx. The server runs with a small context so generation is short."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.core.result import Ok
from schemathesis.core.transport import Response

from api_server.app import RENDERED_ROUTES
from tests.stack import TandemStack

EXAMPLES_PER_MODE = 25


@pytest.fixture(scope="module")
def small(smollm2_dir: Path) -> Iterator[TandemStack]:
    with TandemStack("--max-model-len", "96", "--max-num-seqs", "8") as stack:
        yield stack


def test_openapi_document_lists_every_route(small: TandemStack) -> None:
    doc = httpx.get(f"{small.url}/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    paths = (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/responses",
        "/tokenize",
    )
    for path in (*paths, *(f"{route}/render" for route in RENDERED_ROUTES)):
        assert "post" in doc["paths"][path]
    assert {"get", "delete"} <= set(doc["paths"]["/v1/responses/{response_id}"])
    completion = doc["components"]["schemas"]["CompletionRequest"]
    # Unknown fields are served and reported (vLLM's way; --strict-request-fields refuses them).
    assert completion["additionalProperties"] is True


def fuzz(operation: Any, mode: GenerationMode, url: str) -> set[int]:
    """Run one operation's generated cases; the statuses seen."""
    label = f"{operation.method.upper()} {operation.path}"
    statuses: set[int] = set()

    @settings(
        max_examples=EXAMPLES_PER_MODE,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        response: Response = case.call(base_url=url, timeout=60)
        statuses.add(response.status_code)
        assert response.status_code < 500, (
            f"{label} -> {response.status_code}: {response.text[:500]}\nbody: {case.body!r}"
        )

    check()
    return statuses


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_never_get_a_server_error(small: TandemStack, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{small.url}/openapi.json")
    seen: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        # An operation the schema cannot describe is a test failure, not a skip.
        assert isinstance(result, Ok), result
        operation = result.ok()
        if mode == GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # no body, at most a string in the path: nothing invalid to generate
        seen[f"{operation.method.upper()} {operation.path}"] = fuzz(operation, mode, small.url)
    if mode == GenerationMode.POSITIVE:  # valid bodies were served, not only refused
        assert len(seen) == 15, seen
        for route in RENDERED_ROUTES:  # the prompt's token ids, for a router
            assert 200 in seen[f"POST {route}/render"], seen
        for route in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"):
            assert 200 in seen[f"POST {route}"], seen
    else:  # invalid bodies were refused
        assert len(seen) == 8, seen  # the POST routes
        assert {422, 400} & seen["POST /v1/completions"], seen
    assert httpx.get(f"{small.url}/health").status_code == 200
