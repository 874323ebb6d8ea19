"""A worker's end of the KV hand-off, chosen once (``kv_wiring.py``): ``NoTransport``
(a unified pool, or split pools on one shared segment), ``SendTransport`` (the prefill
side over TCP), ``ReceiveTransport`` (the decode side over TCP) or ``PullTransport`` (the
decode side copying out of the prefill ranks' segments), or, for an instance of a fleet's
prefill/decode split, a sender, a receiver or ``SendReceiveTransport`` (both). The model runner applies each
step's KV orders through it, collects the transfers that ended and closes it; it never
asks which one it holds.
"""

from __future__ import annotations

from typing import Protocol

import torch

from common.messages import KVTransferResult, SchedulerOutput
from worker.kv_receiver import KVReceiver
from worker.kv_reshard import KVPuller
from worker.kv_transfer import KVSender


class KVTransport(Protocol):
    @property
    def address(self) -> str:
        """Where prefill ranks stream this worker's KV (a TCP receiver), else empty."""
        ...

    @property
    def wakes_worker(self) -> bool:
        """Whether transfers end on a thread of its own, posting to ``NOTIFY_ADDRESS``."""
        ...

    def apply(self, step: SchedulerOutput, caches: list[torch.Tensor]) -> list[str]:
        """Carry out the step's KV orders before its forward; returns the transfers whose
        blocks were copied out (the engine may free them)."""
        ...

    def results(self) -> list[KVTransferResult]:
        """Transfers that ended on this side since the last call."""
        ...

    def close(self) -> None: ...


class NoTransport:
    address = ""
    wakes_worker = False

    def apply(self, step: SchedulerOutput, caches: list[torch.Tensor]) -> list[str]:
        return []

    def results(self) -> list[KVTransferResult]:
        return []

    def close(self) -> None:
        return None


class SendTransport:
    """The prefill side over TCP: copies a request's blocks out and streams them."""

    address = ""
    wakes_worker = False

    def __init__(self, sender: KVSender) -> None:
        self.sender = sender

    def apply(self, step: SchedulerOutput, caches: list[torch.Tensor]) -> list[str]:
        for transfer_id in step.kv_cancels:
            self.sender.cancel(transfer_id)
        for send in step.kv_sends:
            self.sender.send(send, caches)
        return [send.transfer_id for send in step.kv_sends]

    def results(self) -> list[KVTransferResult]:
        return self.sender.take_failures()

    def close(self) -> None:
        self.sender.close()


class ReceiveTransport:
    """The decode side over TCP: lands streamed blocks where the engine said."""

    wakes_worker = True

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver

    @property
    def address(self) -> str:
        return self.receiver.address

    def apply(self, step: SchedulerOutput, caches: list[torch.Tensor]) -> list[str]:
        for transfer_id in step.kv_cancels:
            self.receiver.cancel(transfer_id)
        for receive in step.kv_receives:
            self.receiver.expect(receive)
        return []

    def results(self) -> list[KVTransferResult]:
        return self.receiver.take_results()

    def close(self) -> None:
        self.receiver.close()


class SendReceiveTransport:
    """An instance that both lends and pulls KV (``kv_role`` ``kv_both``): one sender
    and one receiver, each given the orders of its kind."""

    wakes_worker = True

    def __init__(self, send: SendTransport, receive: ReceiveTransport) -> None:
        self.send = send
        self.receive = receive

    @property
    def address(self) -> str:
        return self.receive.address

    def apply(self, step: SchedulerOutput, caches: list[torch.Tensor]) -> list[str]:
        # A cancel names a transfer of one side; the other has never heard of it.
        self.receive.apply(step, caches)
        return self.send.apply(step, caches)

    def results(self) -> list[KVTransferResult]:
        return [*self.send.results(), *self.receive.results()]

    def close(self) -> None:
        self.send.close()
        self.receive.close()


class PullTransport:
    """The decode side over shared memory between pools of different widths: copies its
    heads out of the prefill ranks' segments within the step."""

    address = ""
    wakes_worker = False

    def __init__(self, puller: KVPuller) -> None:
        self.puller = puller

    def apply(self, step: SchedulerOutput, caches: list[torch.Tensor]) -> list[str]:
        for receive in step.kv_receives:
            self.puller.pull(receive)
        return []

    def results(self) -> list[KVTransferResult]:
        return self.puller.take_results()

    def close(self) -> None:
        self.puller.close()
