"""HTTP routes: the four generation routes (one ``GenerationDriver`` each, with the
format object of its flavour: ``completions.py``, ``chat.py``, ``anthropic_api.py``,
``responses_api.py``), kept responses, models, tokenize, health, readiness, stats,
metrics, cancel.

A generation's path: parse + validate (``protocol.py``) -> template / tokenize ->
``EngineClient`` (``client.py``) -> incremental detokenize + stop strings
(``detokenizer.py``, ``generation.py``) -> SSE chunks or one JSON body (``driver.py``).
Errors are OpenAI error bodies, Anthropic's on ``/v1/messages``.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from api_server.anthropic_api import MessagesFormat
from api_server.app_parts import STATIC_DIR, chat_page, cors, exception_handlers
from api_server.audit_log import AuditLog
from api_server.audit_middleware import audited
from api_server.chat import ChatFormat, ChatTemplate
from api_server.completions import CompletionFormat
from api_server.driver import ApiFormat, GenerationDriver
from api_server.errors import ApiError, ErrorFormat
from api_server.generation import CompletionService
from api_server.guard import Guard
from api_server.http_util import cancel_on_disconnect, key_id_of
from api_server.http_util import parse as http_parse
from api_server.instance_info import InstanceInfo, instance_routes
from api_server.lora_routes import LoRARoutes, adapter_cards
from api_server.metrics import HttpMetrics
from api_server.oidc import TokenVerifier
from api_server.openapi import openapi_document
from api_server.protocol import DetokenizeRequest, TokenizeRequest, now
from api_server.reasoning import REASONING_PARSERS_BY_NAME
from api_server.response_store import ResponseStore
from api_server.responses_api import ResponsesFormat
from common.config import CacheConfig
from common.messages import SchedulerStats

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)
ROUTE_PATHS = frozenset(
    {
        "/",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/completions/render",
        "/v1/chat/completions/render",
        "/v1/messages",
        "/v1/responses",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/livez",
        "/readyz",
        "/metrics",
        "/stats",
        "/openapi.json",
        "/reset_prefix_cache",
        "/get_server_info",
        "/get_load",
        "/kv_event_sources",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)

# Routes whose prompts ``<route>/render`` returns as token ids (vLLM's router reads them).
RENDERED_ROUTES = ("/v1/completions", "/v1/chat/completions")


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def stats_body(s: SchedulerStats) -> dict[str, Any]:
    total = s.num_kv_blocks_total
    return {
        "active_requests": s.num_running,
        "waiting_requests": s.num_waiting,
        "total_requests": s.num_requests_total,
        "tokens_generated": s.num_generated_tokens_total,
        "num_kv_blocks_total": total,
        "num_kv_blocks_in_use": s.num_kv_blocks_in_use,
        "cache_usage": _share(s.num_kv_blocks_in_use, total),
        "num_tokens_scheduled": s.num_tokens_scheduled,
        "preemptions": s.num_preemptions_total,
        "prefix_cache_queries": s.prefix_cache_queries_total,
        "prefix_cache_hits": s.prefix_cache_hits_total,
        "prefix_cache_hit_rate": _share(s.prefix_cache_hits_total, s.prefix_cache_queries_total),
        "worker_threads": s.num_worker_threads,
        "spec_decode": {
            "num_drafts": s.spec_decode_num_drafts,
            "num_draft_tokens": s.spec_decode_num_draft_tokens,
            "num_accepted_tokens": s.spec_decode_num_accepted_tokens,
            "num_accepted_tokens_per_pos": s.spec_decode_num_accepted_tokens_per_pos,
            "acceptance_rate": _share(
                s.spec_decode_num_accepted_tokens, s.spec_decode_num_draft_tokens
            ),
        },
    }


def create_app(
    service: CompletionService,
    chat_template: str | None = None,
    api_keys: tuple[str, ...] = (),
    max_body_bytes: int = 2 * 1024 * 1024,
    max_choices: int = 16,
    strict_fields: bool = False,
    read_timeout_s: float = 30.0,
    allowed_origins: tuple[str, ...] = (),
    api_server_count: int = 1,
    instance: InstanceInfo | None = None,
    tool_call_parser: str = "auto",
    reasoning_parser: str | None = None,
    lora: LoRARoutes | None = None,
    admin_keys: tuple[str, ...] = (),
    verifier: TokenVerifier | None = None,
    audit: AuditLog | None = None,
) -> Starlette:
    reasoning = REASONING_PARSERS_BY_NAME[reasoning_parser] if reasoning_parser else None
    template = ChatTemplate(service, chat_template, tool_call_parser, reasoning)
    chat = ChatFormat(service, template)
    responses = ResponsesFormat(chat, ResponseStore())
    generation_routes: dict[str, ApiFormat] = {
        "/v1/completions": CompletionFormat(service),
        "/v1/chat/completions": chat,
        "/v1/messages": MessagesFormat(template),
        "/v1/responses": responses,
    }
    drivers = {
        path: GenerationDriver(service, fmt, max_choices, strict_fields)
        for path, fmt in generation_routes.items()
    }
    # The error dialect of each path, for the middleware that answers before routing.
    error_formats: dict[str, ErrorFormat] = {
        path: fmt.errors for path, fmt in generation_routes.items()
    }

    async def parse(request: Request, schema: type[T]) -> T:
        return await http_parse(request, schema, service.served_model_name)

    async def tokenize(request: Request) -> Response:
        req = await parse(request, TokenizeRequest)
        tokens = service.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        info = service.client.model
        return JSONResponse(
            {
                "tokens": tokens,
                "count": len(tokens),
                "max_model_len": info.max_model_len if info else None,
            }
        )

    async def detokenize(request: Request) -> Response:
        req = await parse(request, DetokenizeRequest)
        vocab = len(service.tokenizer)
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise ApiError(
                400, f"token id {bad} is outside the vocabulary (size {vocab})", param="tokens"
            )
        return JSONResponse({"prompt": service.tokenizer.decode(req.tokens)})

    async def models(request: Request) -> Response:
        created = now()
        info = service.client.model
        card: dict[str, Any] = {
            "id": service.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "tandem",
            # Applied when a request leaves them out (the model's generation_config.json).
            "sampling_defaults": service.sampling_defaults.model_dump(exclude_none=True),
        }
        if info is not None:
            card["max_model_len"] = info.max_model_len
        return JSONResponse({"object": "list", "data": [card, *adapter_cards(service, created)]})

    async def health(request: Request) -> Response:
        client = service.client
        if service.draining:
            return JSONResponse({"status": "draining", "model_loaded": client.ready}, 503)
        if client.is_dead:
            return JSONResponse(
                {"status": "dead", "model_loaded": False, "reason": client.dead_reason}, 503
            )
        if not client.ready:
            return JSONResponse({"status": "loading", "model_loaded": False}, 503)
        return JSONResponse({"status": "ok", "model_loaded": True})

    async def livez(request: Request) -> Response:
        # Answering at all proves the event loop runs; nothing else is checked.
        return JSONResponse({"status": "alive"})

    async def readyz(request: Request) -> Response:
        client = service.client
        body: dict[str, Any] = {"role": client.role}
        if service.draining:
            reason = "draining: the server is shutting down"
            return JSONResponse({**body, "status": "not_ready", "reason": reason}, 503)
        if client.is_dead:
            return JSONResponse({**body, "status": "not_ready", "reason": client.dead_reason}, 503)
        if not client.heard_from_engine:
            reason = "waiting for the engine core to answer"
            return JSONResponse({**body, "status": "not_ready", "reason": reason}, 503)
        if not client.ready:
            reason = "workers are loading the model and warming up"
            return JSONResponse({**body, "status": "not_ready", "reason": reason}, 503)
        return JSONResponse({**body, "status": "ready"})

    openapi = openapi_document(service.served_model_name)

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(openapi)

    async def metrics(request: Request) -> Response:
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def stats(request: Request) -> Response:
        client = service.client
        body: dict[str, Any] = {**stats_body(client.stats), "engine_ready": client.ready}
        if client.pools:  # split pools: the figures above are totals
            body["pools"] = {name: stats_body(s) for name, s in client.pools.items()}
        if client.kv_transfers is not None:
            body["kv_transfers"] = {
                "outcomes": client.kv_transfers.outcomes,
                "bytes": client.kv_transfers.num_bytes_total,
            }
        return JSONResponse(body)

    async def reset_prefix_cache(request: Request) -> Response:
        service.client.reset_prefix_cache()
        return JSONResponse({"status": "ok"})

    async def cancel(request: Request) -> Response:
        request_id = request.path_params["request_id"]
        owner = key_id_of(request)
        if service.client.cancel(request_id, owner):
            return JSONResponse({"id": request_id, "cancelled": True})
        if api_server_count > 1:
            # Another process of this service may hold it: the engine cancels it there if
            # this caller may. Accepted whether or not it exists, so ids do not leak.
            service.client.forward_cancel(request_id, owner)
            return JSONResponse({"id": request_id, "cancelled": "forwarded"}, 202)
        raise ApiError(
            404,
            f"no request {request_id} in flight on this server",
            "not_found_error",
            code="request_not_found",
        )

    return Starlette(
        routes=[
            Route("/", chat_page, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
            *(
                Route(path, cancel_on_disconnect(driver.handle), methods=["POST"])
                for path, driver in drivers.items()
            ),
            *(
                Route(f"{path}/render", drivers[path].render, methods=["POST"])
                for path in RENDERED_ROUTES
            ),
            *instance_routes(
                instance or InstanceInfo(service.served_model_name, CacheConfig().block_size),
                lambda: service.client.stats.num_running + service.client.stats.num_waiting,
            ),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/livez", livez, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/openapi.json", openapi_json, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
            Route("/v1/requests/{request_id}/cancel", cancel, methods=["POST"]),
            *(lora.routes() if lora is not None else []),
            Route("/v1/responses/{response_id}", responses.get, methods=["GET"]),
            Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        ],
        exception_handlers=exception_handlers(error_formats, max_body_bytes, read_timeout_s),
        middleware=[
            *cors(allowed_origins),
            *audited(audit),  # outside the guard: its refusals have their lines too
            Middleware(HttpMetrics, metrics=service.metrics, routes=ROUTE_PATHS),
            Middleware(
                Guard,
                api_keys=api_keys,
                max_body_bytes=max_body_bytes,
                limiter=service.limiter,
                error_formats=error_formats,
                read_timeout_s=read_timeout_s,
                admin_keys=admin_keys,
                verifier=verifier,
            ),
        ],
    )
