"""The wire format is pinned: fields are only ever appended."""

from __future__ import annotations

import msgspec
import pytest

from common.ipc import Codec
from common.messages import (
    AbortRequests,
    EngineInput,
    EngineRequest,
    FinishReason,
    LoadLoRAAdapter,
    LoRARequest,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
    UnloadLoRAAdapter,
    WorkerInput,
)


def test_engine_request_encoding_is_pinned() -> None:
    request = EngineRequest(
        "r1", b"c", [1, 2], SamplingParams(max_tokens=3, temperature=0.5), 2.0, priority=1
    )
    encoded = msgspec.msgpack.encode(request)
    assert msgspec.msgpack.decode(encoded) == [
        "EngineRequest",
        "r1",
        b"c",
        [1, 2],
        # ... min_tokens, then logit_bias, allowed_token_ids, structured (appended)
        # ... then prompt_logprobs (appended)
        [3, 0.5, 1.0, 0, None, [], False, 0.0, 1.0, 0.0, 0.0, None, 0, None, None, None, None],
        2.0,
        1,
        None,  # cache_salt, appended after priority
        None,  # owner, appended after cache_salt
        None,  # kv_transfer (a fleet's prefill/decode split), appended after owner
        None,  # lora (the request's LoRA adapter), appended after kv_transfer
        None,  # trace_headers (W3C trace context, with tracing on), appended after lora
    ]


def test_tagged_unions_round_trip() -> None:
    codec: Codec[EngineInput] = Codec(EngineInput)
    for message in (
        EngineRequest("r1", b"c", [5], SamplingParams(), 1.0),
        AbortRequests(["r1", "r2"]),
        EngineRequest("r2", b"c", [5], SamplingParams(), 1.0, lora=LoRARequest("sql", 3, "/a")),
        LoadLoRAAdapter("sql", "/a"),
        UnloadLoRAAdapter("sql"),
    ):
        assert codec.decode(codec.encode(message)) == message
    work: Codec[WorkerInput] = Codec(WorkerInput)
    step = SchedulerOutput(3, [], [], {"a": 2}, ["b"])
    assert work.decode(work.encode(step)) == step


def test_finish_reason_words() -> None:
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "error"]
    out = RequestOutput("r", [1], FinishReason.LENGTH)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(out)) == [
        "r",
        [1],
        1,
        None,
        None,
        0,
        None,
        None,
        None,  # kv_transfer_params, appended after timings
        None,  # error_param
        None,  # prompt_logprobs
    ]


@pytest.mark.parametrize("frame", [b"", b"\x93\x01", msgspec.msgpack.encode(["Nope", 1]), b"\xc1"])
def test_malformed_frames_raise_decode_error(frame: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        Codec(EngineInput).decode(frame)
