"""The autoscalers of deploy/k8s/ read metrics the live server exports at ``GET /metrics``.

Every metric a KEDA ScaledObject's Prometheus query names must be one ``jaxmoe serve`` exposes,
each label it matches on must be one of that metric's labels or one Prometheus adds to every
sample of the scrape (the PodMonitor's target labels), and each ``tier`` value must be a real tier
whose series the server exports before any request has arrived. (tests/deploy/test_deploy.py checks
the rest of the manifests offline; this one needs the ``server`` fixture of tests/serve/.)
"""

import pathlib
import re

import pytest
import yaml

from jaxmoe.serve.tiers import TIERS

AUTOSCALING = pathlib.Path(__file__).parents[2] / "deploy" / "k8s" / "autoscaling.yaml"
# Target labels the Prometheus Operator puts on every sample of a PodMonitor's targets.
OPERATOR_TARGET_LABELS = {"namespace", "pod", "container", "endpoint", "job", "instance"}
SELECTOR_RE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}")
MATCHER_RE = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"([^"]*)"\s*')
IDENT_RE = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
PROMQL_WORDS = {"sum", "avg", "max", "min", "count", "by", "without", "on", "ignoring", "and", "or", "unless"}


def autoscaling_docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(AUTOSCALING.read_text()) if d is not None]


def exposed(text: str) -> dict[str, set[frozenset]]:
    """``{sample name: its label sets}`` of a /metrics page: the names PromQL selects (``_total``, ``_bucket``...)."""
    samples: dict[str, set[frozenset]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            labels = frozenset(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="([^"]*)"', rest.rpartition("}")[0]))
            samples.setdefault(name.split()[0], set()).add(labels)
    return samples


def query_selectors(query: str) -> list[tuple[str, dict]]:
    """``(metric, {label: value})`` per selector; a bare metric name (no braces) is refused."""
    bare = [w for w in IDENT_RE.findall(SELECTOR_RE.sub(" ", query)) if w not in PROMQL_WORDS]
    assert not bare, f"{query!r}: metric names outside a selector: {bare}"
    out = []
    for metric, body in SELECTOR_RE.findall(query):
        matchers = [MATCHER_RE.fullmatch(m) for m in body.split(",")]
        assert all(matchers), f"{query!r}: label=\"value\" matchers expected"
        out.append((metric, {m.group(1): m.group(2) for m in matchers}))
    return out


def test_autoscaler_queries_name_exposed_metrics_and_real_tiers(server):
    docs = autoscaling_docs()
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    target_labels = OPERATOR_TARGET_LABELS | {
        re.sub(r"[^A-Za-z0-9_]", "_", label) for label in monitor["spec"]["podTargetLabels"]
    }
    metrics = exposed(server.metrics())
    assert "jaxmoe_queue_depth" in metrics and "jaxmoe_generated_tokens_total" in metrics  # the parser reads the page
    queries = [t["metadata"]["query"] for d in docs if d["kind"] == "ScaledObject" for t in d["spec"]["triggers"]]
    assert len(queries) == len(TIERS)
    tiers_seen = set()
    for query in queries:
        found = query_selectors(query)
        assert {m for m, _ in found} >= {"jaxmoe_queue_depth"}, query
        for metric, labels in found:
            assert metric in metrics, f"{query!r}: {metric} is not at GET /metrics"
            own = {k for label_set in metrics[metric] for k, _ in label_set}
            assert set(labels) <= own | target_labels, f"{metric}: labels {set(labels) - own - target_labels} unknown"
            assert labels.keys() & own == {"tier"} and labels["tier"] in TIERS, f"{metric}: tier {labels.get('tier')!r}"
            # The server exports the series from the start, so the autoscaler reads 0, never nothing.
            assert any(("tier", labels["tier"]) in label_set for label_set in metrics[metric])
            tiers_seen.add(labels["tier"])
    assert tiers_seen == set(TIERS)


def test_the_query_parser_refuses_a_bare_metric_name():
    assert query_selectors('sum(jaxmoe_queue_depth{tier="low"})') == [("jaxmoe_queue_depth", {"tier": "low"})]
    with pytest.raises(AssertionError, match="outside a selector.*jaxmoe_queue_depth"):
        query_selectors("sum(jaxmoe_queue_depth) + 1")
