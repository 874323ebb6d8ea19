"""The model router's ``/metrics``: every loaded model's series in one exposition (each
family once, its samples from every service, told apart by their ``model_name`` label)
plus the router's own per model: loaded or not, loads and unloads so far."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from api_server.model_slots import ModelService, SlotState

PREFIX = "tandem:"


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def _router_families(services: Iterable[ModelService]) -> list[Metric]:
    loaded = GaugeMetricFamily(
        PREFIX + "model_loaded",
        "1 while the model is loaded (several models).",
        labels=["model_name"],
    )
    loads = CounterMetricFamily(
        PREFIX + "model_loads",
        "Times the model was loaded (several models).",
        labels=["model_name"],
    )
    unloads = CounterMetricFamily(
        PREFIX + "model_unloads",
        "Times the model was unloaded to make room (several models).",
        labels=["model_name"],
    )
    for s in services:
        loaded.add_metric([s.name], 1.0 if s.state is SlotState.READY else 0.0)
        loads.add_metric([s.name], s.loads)
        unloads.add_metric([s.name], s.unloads)
    return [loaded, loads, unloads]


def merged_exposition(
    texts: list[tuple[str, str]], services: Iterable[ModelService]
) -> tuple[bytes, str]:
    """One exposition of the services' texts (model name, text) and the router's own
    series, and its content type. A series a service does not label by model (its HTTP
    counters) gets the ``model_name`` label here, so no two services' series collide."""
    families: dict[str, Metric] = {}
    for model, text in texts:
        for family in text_string_to_metric_families(text):
            family.samples = [
                s
                if "model_name" in s.labels
                else s._replace(labels={**s.labels, "model_name": model})
                for s in family.samples
            ]
            kept = families.setdefault(family.name, family)
            if kept is not family and kept.type == family.type:
                kept.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*families.values(), *_router_families(services)]))
    return generate_latest(registry), CONTENT_TYPE_LATEST
