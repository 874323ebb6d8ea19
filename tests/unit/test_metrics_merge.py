"""The model router's ``/metrics`` (``api_server/metrics_merge.py``): each family once,
every service's samples in it, each series told apart by ``model_name``."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from api_server.metrics_merge import merged_exposition
from api_server.model_slots import ModelService, SlotState
from common.config import TandemConfig

TEXT = """# HELP tandem:generation_tokens_total Generated tokens.
# TYPE tandem:generation_tokens_total counter
tandem:generation_tokens_total{{model_name="{model}"}} {tokens}
# HELP tandem:http_requests_total HTTP requests.
# TYPE tandem:http_requests_total counter
tandem:http_requests_total{{route="/v1/completions",status="200"}} {requests}
"""


def test_the_services_series_merge_by_family_each_labelled_by_model() -> None:
    a, b = (ModelService(n, TandemConfig().for_model(n)) for n in ("a", "b"))
    a.state, a.loads, b.loads, b.unloads = SlotState.READY, 2, 1, 1
    texts = [
        ("a", TEXT.format(model="a", tokens=5, requests=3)),
        ("b", TEXT.format(model="b", tokens=7, requests=4)),
    ]
    body, content_type = merged_exposition(texts, [a, b])
    assert content_type.startswith("text/plain")
    text = body.decode()
    assert text.count("# TYPE tandem:generation_tokens_total counter") == 1
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    route = (("model_name", "a"), ("route", "/v1/completions"), ("status", "200"))
    assert samples[("tandem:http_requests_total", route)] == 3.0
    route_b = (("model_name", "b"), ("route", "/v1/completions"), ("status", "200"))
    assert samples[("tandem:http_requests_total", route_b)] == 4.0
    assert samples[("tandem:generation_tokens_total", (("model_name", "b"),))] == 7.0
    assert samples[("tandem:model_loaded", (("model_name", "a"),))] == 1.0
    assert samples[("tandem:model_loaded", (("model_name", "b"),))] == 0.0
    assert samples[("tandem:model_loads_total", (("model_name", "a"),))] == 2.0
    assert samples[("tandem:model_unloads_total", (("model_name", "b"),))] == 1.0
