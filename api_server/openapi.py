"""The server's OpenAPI 3.1 document, built from the same pydantic models that validate
requests, so the document cannot drift from what the server accepts."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from api_server.anthropic_protocol import MessagesRequest
from api_server.chat_protocol import ChatCompletionRequest
from api_server.protocol import (
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from api_server.responses_protocol import ResponsesRequest

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}

_POST: list[tuple[str, type[BaseModel], str]] = [
    ("/v1/completions", CompletionRequest, "Create a text completion (OpenAI)"),
    ("/v1/chat/completions", ChatCompletionRequest, "Create a chat completion (OpenAI)"),
    ("/v1/completions/render", CompletionRequest, "A completion's prompt token ids"),
    ("/v1/chat/completions/render", ChatCompletionRequest, "A chat's prompt token ids"),
    ("/v1/messages", MessagesRequest, "Create a message (Anthropic)"),
    ("/v1/responses", ResponsesRequest, "Create a response (OpenAI Responses)"),
    ("/tokenize", TokenizeRequest, "Tokenize a prompt"),
    ("/detokenize", DetokenizeRequest, "Turn token ids back into text"),
]

_GET: list[tuple[str, str]] = [
    ("/v1/models", "The served model"),
    ("/health", "200 when the model is loaded and the engine alive, else 503"),
    ("/livez", "200 while the HTTP process runs"),
    ("/readyz", "200 when ready to serve, else 503 with a reason"),
    ("/stats", "Scheduler and KV-cache figures"),
]


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def openapi_document(served_model_name: str) -> dict[str, Any]:
    """Every JSON route with its request schema and the error responses it can give."""
    refs, defs = models_json_schema(
        [(model, "validation") for _, model, _ in _POST],
        ref_template="#/components/schemas/{model}",
    )
    schemas: dict[str, Any] = defs.get("$defs", {})
    for schema in schemas.values():  # the one model this server serves (others: 404)
        model = schema.get("properties", {}).get("model")
        if model is not None:
            model["enum"] = [served_model_name]
    errors = {
        "400": _json(_ERROR, "Malformed request"),
        "401": _json(_ERROR, "Missing or invalid API key"),
        "404": _json(_ERROR, "Unknown model"),
        "413": _json(_ERROR, "Body over the size limit"),
        "422": _json(_ERROR, "A field is invalid or unsupported"),
        "429": _json(_ERROR, "Rate limited; see Retry-After"),
        "503": _json(_ERROR, "Queue full or engine not ready; see Retry-After"),
    }
    paths: dict[str, Any] = {}
    for path, model, summary in _POST:
        paths[path] = {
            "post": {
                "summary": summary,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": refs[(model, "validation")]}},
                },
                "responses": {"200": _json({"type": "object"}, "Success"), **errors},
            }
        }
    for path, summary in _GET:
        paths[path] = {
            "get": {
                "summary": summary,
                "responses": {
                    "200": _json({"type": "object"}, "Success"),
                    "503": _json({"type": "object"}, "Not ready"),
                },
            }
        }
    kept = "/v1/responses/{response_id}"
    by_id = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    not_kept = {"404": _json(_ERROR, "No such response kept for this API key")}
    paths[kept] = {
        method: {
            "summary": summary,
            "parameters": by_id,
            "responses": {"200": _json({"type": "object"}, "Success"), **not_kept},
        }
        for method, summary in (("get", "A kept response"), ("delete", "Forget a kept response"))
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Tandem",
            "version": "0.1.0",
            "description": f"OpenAI- and Anthropic-compatible API serving {served_model_name}",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
