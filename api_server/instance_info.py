"""What vLLM's router asks an instance about itself, to find its KV event sources
without being told them (Kubernetes service discovery, ``--worker-urls`` alone).

``GET /get_server_info``: the model's identity and the KV block size (the router splits a
prompt into blocks of this many tokens to match them against the events).
``GET /get_load``: requests running and waiting (the router's ``power_of_two`` polls it).
``GET /kv_event_sources``: per publishing rank (here: per block pool), its endpoints as
vLLM's ``KVEventsConfig`` names them, with the wire format declared (``publisher`` zmq,
``encoding`` msgpack, ``schema_version`` 1); a bind address ``tcp://*:P`` the router
resolves to the instance's own host. Empty when events are off.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.kv_events_config import KVEventsConfig


@dataclass(frozen=True)
class InstanceInfo:
    model_id: str
    block_size: int
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    num_kv_managers: int = 1  # pools keeping their own blocks, each publishing
    # The same from every API server process of one instance (the router keys its index
    # by it); the launcher's engine address tells instances on one host apart.
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def server_info(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "model_path": self.model_id,
            "instance_id": self.instance_id,
            "kv_block_size": self.block_size,
        }

    def event_sources(self) -> dict[str, Any]:
        if not self.kv_events.enabled:
            return {}
        sources = {}
        for rank in range(self.num_kv_managers):
            config = self.kv_events.for_pool(rank)
            sources[str(rank)] = {
                **dataclasses.asdict(config),
                "publisher": "zmq",
                "encoding": "msgpack",
                "schema_version": 1,
            }
        return sources


def instance_routes(info: InstanceInfo, load: Callable[[], int]) -> list[Route]:
    async def server_info(request: Request) -> Response:
        return JSONResponse(info.server_info())

    async def kv_event_sources(request: Request) -> Response:
        return JSONResponse(info.event_sources())

    async def get_load(request: Request) -> Response:
        return JSONResponse({"load": load()})

    return [
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/get_load", get_load, methods=["GET"]),
        Route("/kv_event_sources", kv_event_sources, methods=["GET"]),
    ]
