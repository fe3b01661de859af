"""The server's Prometheus metrics, all named ``jaxmoe_*``, in a registry of their own.

A registry per :class:`Metrics` (not prometheus_client's process-wide default) lets several
servers, or several tests, live in one process without "duplicated timeseries" errors.

    jaxmoe_queue_depth{tier}                  gauge      requests waiting for a slot of the tier
    jaxmoe_requests_running{tier}             gauge      requests holding one of the tier's slots
    jaxmoe_requests_total{tier,status}        counter    finished requests (status: the caller's label)
    jaxmoe_request_latency_seconds{tier}      histogram  arrival to last byte
    jaxmoe_time_to_first_token_seconds        histogram  arrival to the first generated token
    jaxmoe_generated_tokens_total             counter    tokens sampled (reasoning included)
    jaxmoe_cache_pages_used                   gauge      cache pages held by live requests
    jaxmoe_cache_prefix_pages                 gauge      cache pages held by prefix-reuse entries only
    jaxmoe_cache_pages_total                  gauge      cache pages in the pool
    jaxmoe_prefix_cache_hit_tokens_total      counter    prompt tokens served from reused pages

The two per-tier gauges are exported for every tier from the start, at 0, so that an autoscaler
reading ``jaxmoe_queue_depth`` sees a value before the first request.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

# Seconds. A Low answer takes well under a second; a Max one may think for 32K tokens.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class Metrics:
    """The server's metrics; each attribute is a prometheus_client metric (``.labels(...)`` etc.).

    Args:
        tiers: the tiers whose queue and running gauges are exported from the start.
    """

    def __init__(self, tiers: Sequence[str]):
        if not tiers or len(set(tiers)) != len(tiers):
            raise ValueError(f"tiers: one or more distinct tier names expected, got {list(tiers)}")
        self.tiers = tuple(tiers)
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("jaxmoe_queue_depth", "Requests waiting for a slot of the tier", ["tier"], registry=r)
        self.requests_running = Gauge(
            "jaxmoe_requests_running", "Requests holding a running slot of the tier", ["tier"], registry=r
        )
        self.requests_total = Counter(
            "jaxmoe_requests_total", "Finished requests by tier and status", ["tier", "status"], registry=r
        )
        self.request_latency = Histogram(
            "jaxmoe_request_latency_seconds",
            "Request latency, arrival to the last byte",
            ["tier"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "jaxmoe_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter(
            "jaxmoe_generated_tokens_total", "Tokens generated, reasoning included", registry=r
        )
        self.cache_pages_used = Gauge("jaxmoe_cache_pages_used", "Cache pages held by live requests", registry=r)
        self.cache_prefix_pages = Gauge(
            "jaxmoe_cache_prefix_pages", "Cache pages held only by prefix-reuse entries", registry=r
        )
        self.cache_pages_total = Gauge("jaxmoe_cache_pages_total", "Cache pages in the pool", registry=r)
        self.prefix_cache_hit_tokens = Counter(
            "jaxmoe_prefix_cache_hit_tokens_total", "Prompt tokens served from reused cache pages", registry=r
        )
        for tier in self.tiers:
            self.queue_depth.labels(tier).set(0)
            self.requests_running.labels(tier).set(0)
            self.request_latency.labels(tier)

    def set_cache_pages(self, used: int, prefix: int, total: int) -> None:
        """Sets the three cache-page gauges from one reading of the page pool."""
        self.cache_pages_used.set(used)
        self.cache_prefix_pages.set(prefix)
        self.cache_pages_total.set(total)

    def request_done(self, tier: str, status: str, latency_s: float) -> None:
        """Counts a finished request and observes its latency."""
        self.requests_total.labels(tier, status).inc()
        self.request_latency.labels(tier).observe(latency_s)

    def render(self) -> tuple[bytes, str]:
        """The exposition text of every metric and its content type (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4


__all__ = ["LATENCY_BUCKETS", "TTFT_BUCKETS", "Metrics"]
