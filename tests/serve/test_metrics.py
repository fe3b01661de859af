"""The server's Prometheus metrics: names, labels, startup values, rendering."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxmoe.serve.metrics import Metrics
from jaxmoe.serve.tiers import TIERS


def samples(metrics):
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain") and "version=0.0.4" in content_type
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_every_tier_gauge_is_exported_at_zero_from_startup():
    got = samples(Metrics(TIERS))
    for tier in TIERS:
        assert got[("jaxmoe_queue_depth", (("tier", tier),))] == 0
        assert got[("jaxmoe_requests_running", (("tier", tier),))] == 0
    for name in ["jaxmoe_cache_pages_used", "jaxmoe_cache_prefix_pages", "jaxmoe_cache_pages_total"]:
        assert got[(name, ())] == 0
    assert got[("jaxmoe_generated_tokens_total", ())] == 0
    assert got[("jaxmoe_prefix_cache_hit_tokens_total", ())] == 0
    assert got[("jaxmoe_time_to_first_token_seconds_count", ())] == 0
    assert got[("jaxmoe_request_latency_seconds_count", (("tier", "max"),))] == 0


def test_values_show_in_the_text():
    m = Metrics(TIERS)
    m.queue_depth.labels("max").set(3)
    m.requests_running.labels("low").inc()
    m.request_done("high", "200", 1.5)
    m.request_done("high", "429", 0.001)
    m.time_to_first_token.observe(0.2)
    m.generated_tokens.inc(17)
    m.set_cache_pages(used=5, prefix=2, total=64)
    m.prefix_cache_hit_tokens.inc(11)
    got = samples(m)
    assert got[("jaxmoe_queue_depth", (("tier", "max"),))] == 3
    assert got[("jaxmoe_requests_running", (("tier", "low"),))] == 1
    assert got[("jaxmoe_requests_total", (("status", "200"), ("tier", "high")))] == 1
    assert got[("jaxmoe_requests_total", (("status", "429"), ("tier", "high")))] == 1
    assert got[("jaxmoe_request_latency_seconds_count", (("tier", "high"),))] == 2
    assert got[("jaxmoe_request_latency_seconds_sum", (("tier", "high"),))] == pytest.approx(1.501)
    assert got[("jaxmoe_time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 1
    assert got[("jaxmoe_time_to_first_token_seconds_bucket", (("le", "0.1"),))] == 0
    assert got[("jaxmoe_generated_tokens_total", ())] == 17
    assert got[("jaxmoe_cache_pages_used", ())] == 5
    assert got[("jaxmoe_cache_prefix_pages", ())] == 2
    assert got[("jaxmoe_cache_pages_total", ())] == 64
    assert got[("jaxmoe_prefix_cache_hit_tokens_total", ())] == 11


def test_registries_are_separate():
    a, b = Metrics(TIERS), Metrics(["solo"])  # a second instance in one process is no duplicate
    a.generated_tokens.inc(5)
    assert samples(b)[("jaxmoe_generated_tokens_total", ())] == 0
    assert ("jaxmoe_queue_depth", (("tier", "solo"),)) in samples(b)
    assert ("jaxmoe_queue_depth", (("tier", "low"),)) not in samples(b)


@pytest.mark.parametrize("tiers", [[], ["low", "low"]])
def test_bad_tiers(tiers):
    with pytest.raises(ValueError, match="tiers"):
        Metrics(tiers)
