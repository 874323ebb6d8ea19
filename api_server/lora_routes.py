"""vLLM's runtime LoRA routes, ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (``{"lora_name": ..., "lora_path": ...}``), and the
adapters' cards in ``/v1/models``.

The engine holds the list of adapters (``engine_core/lora_registry.py``); this server
checks an adapter's files against the model (a 400 naming the problem, the server
serving on), orders the change, and answers once a heartbeat shows it, so the next
request on any API server finds the adapter. The routes are open only with
``--allow-runtime-lora-updating`` (or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) and,
with API keys on, only to an admin key (``TANDEM_ADMIN_API_KEYS``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api_server.errors import ApiError
from api_server.generation import CompletionService
from api_server.http_util import json_body
from common.lora import AdapterError, read_adapter
from common.messages import LoadLoRAAdapter, UnloadLoRAAdapter

ADMIN_API_KEYS_ENV = "TANDEM_ADMIN_API_KEYS"
# How long a load or unload waits for the engine's heartbeat to show it (a few beats).
APPLIED_WITHIN_S = 5.0


def admin_keys_from_env() -> tuple[str, ...]:
    """Comma-separated admin keys: they pass wherever an API key does, and alone may
    change the adapters while keys are on."""
    return tuple(k.strip() for k in os.environ.get(ADMIN_API_KEYS_ENV, "").split(",") if k.strip())


def adapter_cards(service: CompletionService, created: int) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the served adapters, ``parent`` naming the base."""
    return [
        {
            "id": adapter.name,
            "object": "model",
            "created": created,
            "owned_by": "tandem",
            "root": adapter.path,
            "parent": service.served_model_name,
        }
        for adapter in service.client.lora_adapters.values()
    ]


class LoRARoutes:
    def __init__(self, service: CompletionService, max_lora_rank: int, allowed: bool) -> None:
        self.service = service
        self.max_lora_rank = max_lora_rank
        self.allowed = allowed

    def routes(self) -> list[Route]:
        return [
            Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload, methods=["POST"]),
        ]

    async def load(self, request: Request) -> Response:
        name, path = await self._names(request, need_path=True)
        service = self.service
        if name == service.served_model_name or name in service.client.lora_adapters:
            raise ApiError(
                400, f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )
        info = service.model_info()
        try:
            read_adapter(Path(path), info.lora_module_shapes, info.num_layers, self.max_lora_rank)
        except AdapterError as e:
            raise ApiError(400, f"adapter '{name}' refused: {e}", param="lora_path") from None
        service.client.send_control(LoadLoRAAdapter(name, path))
        await self._until(lambda: name in service.client.lora_adapters, f"load '{name}'")
        return Response(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        name, _ = await self._names(request, need_path=False)
        client = self.service.client
        if name not in client.lora_adapters:
            raise ApiError(
                404, f"The lora adapter '{name}' cannot be found.", "not_found_error", "lora_name"
            )
        client.send_control(UnloadLoRAAdapter(name))
        await self._until(lambda: name not in client.lora_adapters, f"unload '{name}'")
        return Response(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _names(self, request: Request, need_path: bool) -> tuple[str, str]:
        if not self.allowed:
            raise ApiError(
                403,
                "runtime LoRA updating is off: start the server with "
                "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
                "permission_error",
            )
        if not request.scope.get("state", {}).get("admin", True):
            raise ApiError(403, "changing LoRA adapters needs an admin API key", "permission_error")
        body = await json_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'lora_name' is required (a string)", param="lora_name")
        if need_path and (not isinstance(path, str) or not path):
            raise ApiError(400, "'lora_path' is required (a folder)", param="lora_path")
        return name, str(path or "")

    async def _until(self, applied: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + APPLIED_WITHIN_S
        while not applied():
            if time.monotonic() > deadline:
                raise ApiError(503, f"the engine did not {what} in time; retry", "server_error")
            await asyncio.sleep(0.02)
