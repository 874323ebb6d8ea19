"""A request's ``kv_transfer_params`` (a fleet's prefill/decode split), checked.

vllm-router sends a prefill instance ``{"do_remote_decode": true, ...}`` with
``max_tokens: 1`` and ``stream: false``, then copies the answer's ``kv_transfer_params``
into the request it sends a decode instance (``do_remote_prefill``). Anything else a
body could carry there is a 400 naming the field; whether the params match a lease is
the prefill instance's to check (``engine_core/kv_leases.py``).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

import msgspec

from api_server.errors import ApiError
from common.messages import KVTransferParams

FIELD = "kv_transfer_params"
# A DNS name: dot-separated labels of letters, digits and inner hyphens.
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)
MAX_BLOCKS = 1 << 20
_AT = re.compile(r"at `\$\.?(\w*)")


def parse_kv_transfer_params(raw: Any, num_choices: int, stream: bool) -> KVTransferParams | None:
    """The params as the engine takes them; None when they ask for nothing."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ApiError(400, f"'{FIELD}' must be an object", param=FIELD)
    try:
        params = msgspec.convert(raw, KVTransferParams, strict=True)
    except msgspec.ValidationError as e:
        found = _AT.search(str(e))
        where = f"{FIELD}.{found.group(1)}" if found and found.group(1) else FIELD
        raise ApiError(400, f"'{where}': {e}", param=where) from None
    if not (params.do_remote_decode or params.do_remote_prefill):
        return None
    if params.do_remote_decode and params.do_remote_prefill:
        raise ApiError(
            400,
            f"'{FIELD}' asks both do_remote_decode and do_remote_prefill",
            param=f"{FIELD}.do_remote_prefill",
        )
    if num_choices != 1:
        raise ApiError(400, f"'{FIELD}' applies to one prompt and one choice ('n': 1)", param="n")
    if params.do_remote_decode and stream:
        raise ApiError(
            400,
            f"'{FIELD}.do_remote_decode' needs 'stream': false (the answer carries the "
            "params the decode instance needs)",
            param="stream",
        )
    if params.do_remote_prefill:
        _check_remote(params)
    return params


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _check_remote(params: KVTransferParams) -> None:
    """What a decode instance needs to reach the prefill instance's lease."""
    required: dict[str, object] = {
        "remote_engine_id": params.remote_engine_id,
        "remote_request_id": params.remote_request_id,
        "remote_host": params.remote_host,
        "remote_port": params.remote_port,
        "remote_block_ids": params.remote_block_ids,
    }
    for name, value in required.items():
        if value is None or value == "":
            raise ApiError(
                400,
                f"'{FIELD}.{name}' is required with do_remote_prefill",
                param=f"{FIELD}.{name}",
            )
    port = params.remote_port or 0
    if not 1 <= port <= 65535:
        raise ApiError(
            400, f"'{FIELD}.remote_port' {port} is no port", param=f"{FIELD}.remote_port"
        )
    host = params.remote_host or ""
    if len(host) > 253 or not (_HOSTNAME.fullmatch(host) or _is_ip(host)):
        raise ApiError(400, f"'{FIELD}.remote_host' is no host name", param=f"{FIELD}.remote_host")
    blocks = params.remote_block_ids or []
    if len(blocks) > MAX_BLOCKS or any(b < 0 for b in blocks):
        raise ApiError(
            400,
            f"'{FIELD}.remote_block_ids' must be at most {MAX_BLOCKS} block ids, none negative",
            param=f"{FIELD}.remote_block_ids",
        )
    if params.tp_size < 1:
        raise ApiError(400, f"'{FIELD}.tp_size' must be at least 1", param=f"{FIELD}.tp_size")
