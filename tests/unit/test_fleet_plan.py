"""``tandem fleet``'s plan: each instance's flags and the router's, from one command line."""

from __future__ import annotations

import json

import pytest

from common.cli_args import parse_config
from common.config import SchedulerConfig, TandemConfig
from common.fleet import Shape, plan_fleet
from common.kv_transfer_config import parse_kv_transfer_config
from common.pool_config import DisaggConfig


def instance_flag(args: list[str], flag: str) -> str:
    return args[len(args) - 1 - args[::-1].index(flag) + 1]  # the last one given wins


def test_kv_aware_is_told_every_instances_event_sources_and_the_block_size() -> None:
    config = parse_config(["--port", "9000", "--block-size", "32", "--log-level", "warning"])
    plan = plan_fleet(config, 3, "kv_aware", 9100, 6000)
    assert [i.url for i in plan.instances] == [f"http://127.0.0.1:{9100 + i}" for i in range(3)]
    endpoints = []
    for inst in plan.instances:
        served = parse_config(inst.args)
        assert served.server.host == "127.0.0.1" and served.cache.block_size == 32
        events = json.loads(instance_flag(inst.args, "--kv-events-config"))
        assert events["enable_kv_cache_events"] and events["endpoint"] == inst.events
        endpoints += [inst.events, inst.replay]
    assert len(set(endpoints)) == 6  # nobody shares a port
    router = plan.router_args
    assert router[router.index("--port") + 1] == "9000"
    sources = [router[i + 1] for i, a in enumerate(router) if a == "--kv-event-source"]
    assert sources == [f"{i.url}={i.events}" for i in plan.instances]
    assert router[router.index("--kv-event-block-size") + 1] == "32"
    assert router[router.index("--log-level") + 1] == "warning"


def test_other_policies_get_no_event_sources_and_bad_counts_are_refused() -> None:
    config = parse_config([])
    plan = plan_fleet(config, 2, "round_robin", 9100, 6000)
    assert "--kv-event-source" not in plan.router_args
    with pytest.raises(ValueError, match="--replicas must be at least 1"):
        plan_fleet(config, 0, "kv_aware", 9100, 6000)
    with pytest.raises(ValueError, match="--policy must be one of"):
        plan_fleet(config, 2, "nearest", 9100, 6000)


def test_a_split_fleet_gets_producers_consumers_and_the_routers_pd_mode() -> None:
    config = parse_config(["--port", "9000"])
    plan = plan_fleet(config, Shape(prefill=1, decode=2), "kv_aware", 9100, 6000, 5, 7000)
    roles = []
    for inst in plan.instances:
        transfer = parse_config(inst.args).disagg.instance_kv
        roles.append((transfer.kv_role, transfer.kv_port))
    assert roles == [("kv_producer", 7000), ("kv_consumer", 7001), ("kv_consumer", 7002)]
    router = plan.router_args
    assert "--vllm-pd-disaggregation" in router and "--worker-urls" not in router
    assert router[router.index("--kv-connector") + 1] == "nixl"
    assert [router[i + 1] for i, a in enumerate(router) if a == "--prefill"] == [
        "http://127.0.0.1:9100"
    ]
    assert [router[i + 1] for i, a in enumerate(router) if a == "--decode"] == [
        "http://127.0.0.1:9101",
        "http://127.0.0.1:9102",
    ]
    events = [router[i + 1] for i, a in enumerate(router) if a == "--pd-kv-events"]
    assert events == [f"http://127.0.0.1:9100={plan.instances[0].events}"]
    with pytest.raises(ValueError, match="--prefill and --decode go together"):
        Shape(prefill=1)


def test_kv_transfer_config_is_vllms_spelling_and_refuses_what_it_does_not_know() -> None:
    parsed = parse_kv_transfer_config(
        '{"kv_connector": "TandemConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",'
        ' "kv_connector_extra_config": {"lease_s": 5}}'
    )
    assert parsed.role.produces and parsed.role.consumes
    assert parsed.kv_connector_extra_config.lease_s == 5
    assert parsed.kv_load_failure_policy == "recompute"
    for text, message in (
        ('{"kv_role": "kv_sender"}', "kv_role must be one of"),
        ('{"kv_role": "kv_producer", "kv_connector": "NixlConnector"}', "is not available"),
        ('{"kv_role": "kv_producer", "kv_porrt": 1}', "unknown field kv_porrt"),
        ('{"kv_connector_extra_config": {"lease": 1}}', "kv_connector_extra_config.lease"),
        ("[1]", "must be a JSON object"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_kv_transfer_config(text)
    with pytest.raises(ValueError, match="one unified pool"):
        DisaggConfig(
            prefill_workers=1, decode_workers=1, kv_transfer_config='{"kv_role": "kv_both"}'
        )
    consumer = DisaggConfig(kv_transfer_config='{"kv_role": "kv_consumer"}')
    with pytest.raises(ValueError, match="needs --enable-prefix-caching"):
        TandemConfig(scheduler=SchedulerConfig(enable_prefix_caching=False), disagg=consumer)
