"""Wire types between instances of a fleet's prefill/decode split (``docs/fleet.md``).

``KVTransferParams`` is the NixlConnector's contract, the ``kv_transfer_params`` a router
copies from a prefill instance's answer into the request it sends a decode instance; it
also rides inside ``EngineRequest`` and ``RequestOutput``. A decode instance's engine
sends ``KVPull`` to the prefill instance's side channel (``kv_ip:kv_port``), which
answers ``KVPullAck`` at once (it is alive and has the pull) and ``KVPullAnswer`` once
its engine has checked the pull against the lease. The KV itself travels on the TCP KV
stream (``worker/kv_transfer.py``) from the prefill worker to the decode worker.
"""

from __future__ import annotations

import msgspec


class KVTransferParams(msgspec.Struct):
    """vLLM's NixlConnector ``kv_transfer_params``, as JSON objects spell them.

    A prefill request asks ``do_remote_decode``; its answer names the lease
    (``remote_request_id``), the prompt's full blocks on the prefill instance
    (``remote_block_ids``), the instance (``remote_engine_id``) and its side channel
    (``remote_host``/``remote_port``). A decode request carries those with
    ``do_remote_prefill``."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int = 1
    block_size: int | None = None  # Tandem: the prefill instance's tokens per block

    @property
    def side_channel(self) -> str:
        host = self.remote_host or ""
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 address, as ZeroMQ spells it
        return f"tcp://{host}:{self.remote_port}"


class KVPull(msgspec.Struct, array_like=True, tag=True):
    """Decode engine -> prefill side channel: send lease ``lease_id``'s blocks
    ``block_ids`` (positions ``first_block`` on of its prompt, whose chained hashes are
    ``block_hashes``) to ``destinations`` as transfer ``transfer_id``, for a request made
    with ``owner``'s key (it must be the prefill request's). No blocks: the
    decode side needs none (it holds them, or gave up); the lease can go."""

    lease_id: str
    engine_id: str
    transfer_id: str
    first_block: int
    block_ids: list[int]
    block_hashes: list[bytes]
    destinations: list[str]
    block_size: int
    owner: str | None = None  # the API key (by digest) of the decode request


class KVPullAck(msgspec.Struct, array_like=True, tag=True):
    """Prefill side channel -> decode engine: the pull reached a live instance."""

    transfer_id: str


class KVPullAnswer(msgspec.Struct, array_like=True, tag=True):
    """Prefill engine -> decode engine: the pull is being sent (``ok``), or why not.
    ``param``: the ``kv_transfer_params`` field found not to match the lease (a forged or
    mistaken request, refused with 400); None for any other failure."""

    transfer_id: str
    ok: bool
    error: str | None = None
    param: str | None = None


PeerMessage = KVPull | KVPullAck | KVPullAnswer
