"""A fleet's prefill/decode split in-process: a producer and a consumer ``EngineCore``
with fake pools, their side-channel messages carried by hand. Exact block ids in the
orders, every lease and pull ended once, and every block of both instances free at the
end of every case."""

from __future__ import annotations

import json

import msgspec
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode, Tracer

from common.config import CacheConfig, SchedulerConfig, TandemConfig
from common.messages import (
    EngineRequest,
    ErrorKind,
    FinishReason,
    KVPull,
    KVPullAck,
    KVReceive,
    KVSend,
    KVTransferParams,
    KVTransferResult,
    PoolRole,
    SamplingParams,
)
from common.pool_config import DisaggConfig
from engine_core.core import EngineCore
from engine_core.kv_cache import KVCacheManager
from engine_core.remote_kv import RemoteKV
from engine_core.request_spans import RequestSpans
from engine_core.scheduler import ClientOutputs
from tests.unit.clock import ManualClock
from tests.unit.fake_pools import BLOCK, FakePool, token_for
from tests.unit.test_engine_core import Outputs, finished, tokens

PROMPT = list(range(1, 11))  # 10 tokens: 2 full blocks of 4, the last token in a third
PEER = b"decode-instance"
TRACE_HEADERS = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


class Instance:
    def __init__(
        self,
        role: str,
        policy: str = "recompute",
        land_polls: int = 1,
        tracer: Tracer | None = None,
    ) -> None:
        transfer = {
            "kv_role": role,
            "engine_id": role,
            "kv_port": 14579,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"lease_s": 30.0, "ack_timeout_s": 0.5},
        }
        config = TandemConfig(
            cache=CacheConfig(block_size=BLOCK, num_kv_blocks=16),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
            disagg=DisaggConfig(kv_transfer_config=json.dumps(transfer)),
        )
        self.pool = FakePool(PoolRole.UNIFIED, 16, land_polls=land_polls, max_in_flight=2)
        self.clock = ManualClock(1000.0)
        # Traced: the spans' wall clock is the engine's (their times compare as they are).
        spans = RequestSpans(tracer, "tiny", self.clock, self.clock) if tracer else None
        self.core = EngineCore(config, {PoolRole.UNIFIED: self.pool}, self.clock, spans=spans)
        self.core.start()
        self.outputs: Outputs = {}

    @property
    def kv(self) -> KVCacheManager:
        return self.core.slots[PoolRole.UNIFIED].scheduler.kv

    def add(
        self,
        request_id: str,
        params: KVTransferParams,
        max_tokens: int = 3,
        prompt: list[int] = PROMPT,
        owner: str | None = None,
    ) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0)
        message = EngineRequest(
            request_id,
            b"client",
            list(prompt),
            sampling,
            0.0,
            owner=owner,
            kv_transfer=params,
            trace_headers=TRACE_HEADERS,  # spans are made only where the instance traces
        )
        self._take(self.core.add_request(message))

    def step(self) -> None:
        self._take(self.core.step().outputs)

    def _take(self, out: ClientOutputs) -> None:
        self.core.spans.finished(out)  # as the engine process does when it sends them
        for o in out.get(b"client", []):
            self.outputs.setdefault(o.request_id, []).append(o)

    def run(self, *ids: str, steps: int = 50) -> None:
        for _ in range(steps):
            if finished(self.outputs, *ids)():
                return
            self.step()
        raise AssertionError(f"not finished: {self.outputs}")

    def outcomes(self) -> dict[str, int]:
        stats = self.core.transfer_stats()
        assert stats is not None
        return {k: v for k, v in stats.outcomes.items() if v}

    def assert_all_free(self) -> None:
        assert self.kv.num_free_blocks == self.kv.num_blocks, self.kv.req_to_blocks
        assert not self.kv.req_to_blocks
        assert not self.core.remote.in_flight


def prefill(
    producer: Instance, request_id: str = "r", owner: str | None = None
) -> KVTransferParams:
    producer.add(request_id, KVTransferParams(do_remote_decode=True), max_tokens=1, owner=owner)
    producer.run(request_id)
    last = producer.outputs[request_id][-1]
    assert last.finish_reason == FinishReason.LENGTH and last.kv_transfer_params is not None
    return last.kv_transfer_params


def carry(producer: Instance, consumer: Instance, ack: bool = True) -> list[KVPull]:
    """Deliver the consumer's pulls (and the side channel's acks), then the answers."""
    pulls = []
    for to, message in consumer.core.take_peer_outbox():
        assert to == "tcp://127.0.0.1:14579" and isinstance(message, KVPull)
        pulls.append(message)
        if ack:
            consumer._take(consumer.core.deliver(b"", KVPullAck(message.transfer_id)))
        producer._take(producer.core.deliver(PEER, message))
    for to, answer in producer.core.take_peer_outbox():
        assert to == PEER
        consumer._take(consumer.core.deliver(b"", answer))
    return pulls


def test_the_decode_instance_pulls_the_full_blocks_and_computes_only_the_last() -> None:
    producer, consumer = Instance("kv_producer"), Instance("kv_consumer")
    params = prefill(producer)
    assert params.remote_block_ids == [0, 1] and params.remote_engine_id == "kv_producer"
    assert params.remote_host == "127.0.0.1" and params.remote_port == 14579
    assert producer.kv.num_used_blocks == 2  # the lease holds the two full blocks
    consumer.add("r", params)
    [pull] = carry(producer, consumer)
    assert (pull.first_block, pull.block_ids, pull.destinations) == (
        0,
        [0, 1],
        ["tcp://fake-decode:1"],
    )
    producer.step()  # its worker copies the blocks out: the lease ends
    assert [s for step in producer.pool.steps for s in step.kv_sends] == [
        KVSend("r#pull0@kv_consumer", [0, 1], ["tcp://fake-decode:1"])
    ]
    consumer.run("r")
    receives = [r for step in consumer.pool.steps for r in step.kv_receives]
    assert receives == [KVReceive("r#pull0@kv_consumer", [0, 1], [1, 1])]
    [new] = [n for step in consumer.pool.steps for n in step.new_requests]
    assert new.num_computed_tokens == 8 and new.block_ids == [0, 1, 2]  # 2 tokens computed
    assert tokens(consumer.outputs, "r") == [token_for("r", n) for n in (10, 11, 12)]
    assert consumer.outputs["r"][0].num_cached_tokens == 8
    assert producer.outcomes() == {"lease_pulled": 1}
    assert consumer.outcomes() == {"done": 1}
    producer.assert_all_free()
    consumer.assert_all_free()


def test_blocks_the_decode_instance_caches_already_are_not_pulled() -> None:
    producer, consumer = Instance("kv_producer"), Instance("kv_consumer")
    consumer.add("warm", KVTransferParams(), max_tokens=1)
    consumer.run("warm")
    consumer.add("r", prefill(producer))
    [release] = carry(producer, consumer)
    assert release.block_ids == []  # the lease can go
    consumer.run("r")
    assert producer.outcomes() == {"lease_released": 1}
    assert consumer.outcomes() == {"local_prefill": 1}
    producer.assert_all_free()
    consumer.assert_all_free()


def test_a_forged_or_foreign_pull_is_a_400_naming_the_field_and_reads_nothing() -> None:
    producer, consumer = Instance("kv_producer"), Instance("kv_consumer")
    params = prefill(producer, owner="key:alice")
    other = [9, *PROMPT[1:]]
    forged = [
        (
            msgspec.structs.replace(params, remote_engine_id="x"),
            PROMPT,
            "alice",
            "remote_engine_id",
        ),
        (
            msgspec.structs.replace(params, remote_block_ids=[1, 0]),
            PROMPT,
            "alice",
            "remote_block_ids",
        ),
        (params, other, "alice", "remote_request_id"),  # another prompt
        (params, PROMPT, "mallory", "remote_request_id"),  # another key
    ]
    for i, (bad, prompt, who, field) in enumerate(forged):
        consumer.add(f"f{i}", bad, prompt=prompt, owner=f"key:{who}")
        carry(producer, consumer)
        [refusal] = consumer.outputs[f"f{i}"]
        assert refusal.error_kind == ErrorKind.INVALID
        assert refusal.error_param == f"kv_transfer_params.{field}"
    assert not any(step.kv_sends for step in producer.pool.steps)  # no byte left
    assert producer.outcomes() == {"pull_refused": 4}
    assert consumer.outcomes() == {"refused": 4}
    consumer.add("ok", params, owner="key:alice")  # the lease is still there for its owner
    carry(producer, consumer)
    producer.step()
    consumer.run("ok")
    producer.assert_all_free()
    consumer.assert_all_free()


def test_no_ack_within_the_timeout_recomputes_or_fails_by_policy() -> None:
    for policy in ("recompute", "fail"):
        producer, consumer = Instance("kv_producer"), Instance("kv_consumer", policy)
        consumer.add("r", prefill(producer))
        consumer.core.take_peer_outbox()  # the prefill instance is gone: nothing arrives
        consumer.clock.now += 0.6
        consumer.run("r")
        outputs = consumer.outputs["r"]
        if policy == "recompute":
            assert tokens(consumer.outputs, "r") == [token_for("r", n) for n in (10, 11, 12)]
            [new] = [n for step in consumer.pool.steps for n in step.new_requests]
            assert new.num_computed_tokens == 0  # the whole prompt, here
        else:
            assert outputs[-1].finish_reason == FinishReason.ERROR
            assert "no answer from the prefill instance within 0.5 s" in (outputs[-1].error or "")
        assert consumer.outcomes() == {"expired": 1}
        consumer.assert_all_free()
        # The prefill side's lease runs out on its own.
        producer.clock.now += 31
        producer.step()
        assert producer.outcomes() == {"lease_expired": 1}
        producer.assert_all_free()


def test_an_acked_pull_not_landed_in_time_expires_and_a_bad_landing_recomputes() -> None:
    producer, consumer = Instance("kv_producer"), Instance("kv_consumer", land_polls=10_000)
    consumer.add("r", prefill(producer))
    carry(producer, consumer)
    producer.step()
    consumer.step()
    consumer.clock.now += 31  # acked, never landed
    consumer.run("r")
    assert consumer.outcomes() == {"expired": 1}
    assert any("r#pull0@kv_consumer" in step.kv_cancels for step in consumer.pool.steps)
    consumer.assert_all_free()
    producer.assert_all_free()

    producer, consumer = Instance("kv_producer"), Instance("kv_consumer")
    consumer.pool.fail_transfers.add("r#pull0@kv_consumer")
    consumer.add("r", prefill(producer))
    carry(producer, consumer)
    producer.step()
    consumer.run("r")
    assert consumer.outcomes() == {"failed": 1}
    assert tokens(consumer.outputs, "r") == [token_for("r", n) for n in (10, 11, 12)]
    consumer.assert_all_free()


def test_an_abort_while_pulling_cancels_the_landing_and_releases_the_lease() -> None:
    producer, consumer = Instance("kv_producer"), Instance("kv_consumer", land_polls=10_000)
    consumer.add("r", prefill(producer))
    consumer._take(consumer.core.abort(["r"]))
    assert consumer.outputs["r"][-1].finish_reason == FinishReason.ABORT
    pulls = carry(producer, consumer)
    assert [p.block_ids for p in pulls] == [[0, 1], []]  # the pull, then its release
    consumer.step()
    assert any("r#pull0@kv_consumer" in step.kv_cancels for step in consumer.pool.steps)
    producer.step()
    assert consumer.outcomes() == {"aborted": 1}
    assert producer.outcomes() == {"lease_pulled": 1}  # sent already: the release is moot
    consumer.assert_all_free()
    producer.assert_all_free()


def test_an_instance_refuses_params_its_role_does_not_take() -> None:
    producer, consumer = Instance("kv_producer"), Instance("kv_consumer")
    consumer.add("d", KVTransferParams(do_remote_decode=True), max_tokens=1)
    producer.add("p", prefill(producer, "first"))
    assert consumer.outputs["d"][0].error_param == "kv_transfer_params.do_remote_decode"
    assert producer.outputs["p"][0].error_param == "kv_transfer_params.do_remote_prefill"
    producer.clock.now += 31
    producer.step()
    producer.assert_all_free()
    consumer.assert_all_free()


def test_pulls_that_fill_the_cache_still_all_finish() -> None:
    """Seven pulls of two blocks each into a 16-block cache: landed requests run as
    hand-offs do, so the scheduler preempts among them when blocks run short, and every
    one finishes with its own tokens (none waits forever on blocks the pulls hold)."""
    producer, consumer = Instance("kv_producer"), Instance("kv_consumer")
    ids = [f"r{i}" for i in range(7)]
    prompts = {rid: [100 + 10 * i + t for t in range(10)] for i, rid in enumerate(ids)}
    for rid in ids:
        producer.add(
            rid, KVTransferParams(do_remote_decode=True), max_tokens=1, prompt=prompts[rid]
        )
    producer.run(*ids)
    for rid in ids:
        params = producer.outputs[rid][-1].kv_transfer_params
        assert params is not None
        consumer.add(rid, params, prompt=prompts[rid])
    for _ in range(200):
        carry(producer, consumer)
        producer.step()
        consumer.step()
        if finished(consumer.outputs, *ids)():
            break
    for rid in ids:
        assert tokens(consumer.outputs, rid) == [token_for(rid, n) for n in (10, 11, 12)]
    assert consumer.outcomes()["done"] == 7
    assert consumer.core.stats().num_preemptions_total > 0  # blocks did run short
    producer.assert_all_free()
    consumer.assert_all_free()


def test_a_send_that_fails_after_the_copy_is_still_reported_to_the_puller() -> None:
    producer, consumer = Instance("kv_producer"), Instance("kv_consumer", land_polls=10_000)
    consumer.add("r", prefill(producer))
    [pull] = carry(producer, consumer)
    producer.step()  # copied out: the lease ends as pulled
    assert producer.outcomes() == {"lease_pulled": 1}
    failure = KVTransferResult(pull.transfer_id, False, "send failed: connection refused")
    remote = producer.core.remote
    assert isinstance(remote, RemoteKV)
    remote.side.on_result(failure)  # the sender thread's report, a step later
    carry(producer, consumer)
    consumer.run("r")  # told at once: recomputed, long before the 30 s deadline
    assert consumer.outcomes() == {"failed": 1}
    assert tokens(consumer.outputs, "r") == [token_for("r", n) for n in (10, 11, 12)]
    consumer.assert_all_free()


def traced_consumer() -> tuple[Instance, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Instance("kv_consumer", tracer=provider.get_tracer("test")), exporter


def test_a_traced_pull_is_its_requests_kv_handoff_span() -> None:
    producer = Instance("kv_producer")
    consumer, exporter = traced_consumer()
    consumer.add("r", prefill(producer))
    sent = consumer.clock.now
    carry(producer, consumer)
    consumer.clock.now += 0.25  # the blocks take a while to land
    producer.step()
    consumer.run("r")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    handoff, root = spans["kv_handoff"], spans["llm_request"]
    assert handoff.parent is not None and handoff.parent.span_id == root.context.span_id
    assert handoff.attributes == {
        "tandem.kv.outcome": "done",
        "tandem.kv.num_blocks": 2,
        "tandem.kv.num_bytes": 4096,  # as the fake pool's landing reported
        "tandem.kv.source_engine_id": "kv_producer",
    }
    assert handoff.start_time == int(sent * 1e9)
    assert handoff.end_time is not None and handoff.end_time >= int((sent + 0.25) * 1e9)
    assert handoff.status.status_code == StatusCode.UNSET


def test_a_pull_that_expired_is_an_error_span_and_the_prompt_is_computed_here() -> None:
    producer = Instance("kv_producer")
    consumer, exporter = traced_consumer()
    consumer.add("r", prefill(producer))
    consumer.core.take_peer_outbox()  # the prefill instance is gone: nothing arrives
    consumer.clock.now += 0.6
    consumer.run("r")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    handoff = spans["kv_handoff"]
    assert (handoff.attributes or {})["tandem.kv.outcome"] == "expired"
    assert handoff.status.status_code == StatusCode.ERROR
    assert "prefill_chunk" in spans  # recomputed here
