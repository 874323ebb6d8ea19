"""``tandem fleet``'s plan: each instance's flags and the router's, from one command line."""

from __future__ import annotations

import json

import pytest

from common.cli_args import parse_config
from common.fleet import plan_fleet


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
