"""Prometheus metrics for the HTTP server: ``GET /metrics`` in the text format.

* ``mstar_http_requests_total{route, method, status}`` and
  ``mstar_http_request_duration_seconds{route}`` (end to end, until the last byte of a
  stream): counted by ``MetricsMiddleware``, a plain ASGI middleware (it does not
  interfere with streaming or disconnect detection).
* ``mstar_time_to_first_output_seconds{route}``: from the request's arrival to the
  backend's first output event (``observe_first_output``).
* Gauges read from the backend at scrape time (its optional ``gauges()``):
  ``mstar_requests_waiting`` (queue depth), ``mstar_requests_running``, and every engine
  gauge ``rank<R>.<node>.<stat>`` as ``mstar_<stat>{rank, node}`` (e.g.
  ``mstar_kv_pages_used`` and ``mstar_kv_pages_total`` per KV pool; with prefix caching,
  ``mstar_kv_pages_cached`` and the running totals ``mstar_prefix_cache_queried_tokens`` and
  ``mstar_prefix_cache_hit_tokens``, whose ratio is the hit rate; ``mstar_sessions_held`` per
  node that keeps session state); ``mstar_sessions_open`` and ``mstar_sessions_busy`` (the
  frontend's session book); ``mstar_healthy``; for a model that clones voices, its clip
  memo's running ``mstar_conditioning_cache_hits`` and ``..._misses`` and the
  ``..._entries`` and ``..._bytes`` it keeps.

Each app has its own registry, so several apps in one process never clash.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable

from fastapi import Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ARRIVAL = "mstar.arrival"  # scope key: perf_counter() when the request arrived
_UNMATCHED = "unmatched"  # the route label of requests that matched no route (bounded cardinality)

_DOCS = {
    "requests_waiting": "Requests accepted and waiting for admission (the queue depth)",
    "requests_running": "Requests admitted and running",
    "requests_routed": "Requests sent to each data-parallel replica since the start",
    "replica_healthy": "1 while a data-parallel replica takes requests, 0 while a rank of it is down",
    "kv_pages_used": "KV cache pages in use, per worker rank and node (pool)",
    "kv_pages_total": "KV cache pages in the pool, per worker rank and node",
    "kv_pages_cached": "KV cache pages holding a cached prompt prefix (held or idle), per worker rank and node",
    "prefix_cache_queried_tokens": "Prompt tokens looked up in the prefix cache since startup, per rank and node",
    "prefix_cache_hit_tokens": "Prompt tokens found in the prefix cache (not computed) since startup, "
                               "per rank and node",
    "preemptions": "Sequences preempted since start (KV pages freed, recomputed later), per worker rank and node",
    "sessions_open": "Sessions kept (idle or with a request in flight), as the frontend's book counts them",
    "sessions_busy": "Sessions with a request in flight",
    "sessions_held": "Sessions whose state a node keeps on its worker rank, per rank and node",
    "session_bytes": "Bytes of the session state a node keeps on its worker rank (tensors and caches that "
                     "report their size), per rank and node",
    "conditioning_cache_hits": "Reference clips whose conditioning came from the memo since startup",
    "conditioning_cache_misses": "Reference clips encoded since startup (not in the memo)",
    "conditioning_cache_entries": "Reference clips whose conditioning the memo keeps",
    "conditioning_cache_bytes": "Bytes of reference-clip conditioning the memo keeps",
    "prefills_deferred": "Prompts sent back to wait a step because a step's prefill budget "
                         "(model_kwargs.max_prefill_tokens) was spent, per rank and node",
}


def _metric_name(name: str) -> str:
    return "mstar_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


class _BackendGauges(Collector):
    """Turns the backend's ``gauges()`` into Prometheus gauges on every scrape."""

    def __init__(self, backend: object):
        self.backend = backend

    def describe(self) -> Iterable[Metric]:
        return []  # the names depend on the engines: registration must not scrape

    def collect(self) -> Iterable[Metric]:
        families: dict[str, GaugeMetricFamily] = {}
        try:
            healthy = bool(self.backend.healthy())  # type: ignore[attr-defined]
            gauges = getattr(self.backend, "gauges", None)
            values = gauges() if gauges is not None else {}
        except Exception:  # a scrape must never fail the server
            log.exception("reading the backend's gauges failed")
            return []
        families["healthy"] = GaugeMetricFamily("mstar_healthy", "1 while the backend serves, 0 once it failed",
                                                value=float(healthy))
        replicated = any(_replica_of(key)[0] is not None for key in values)
        for key, value in sorted(values.items()):
            replica, key = _replica_of(key)
            extra = [replica] if replicated and replica is not None else []
            extra_names = ["replica"] if extra else []
            rank, _, rest = key.partition(".")
            node, _, stat = rest.partition(".")
            if rank.startswith("rank") and rank[4:].isdigit() and node and stat:
                family = families.get(stat)
                if family is None:
                    doc = _DOCS.get(stat, f"Engine gauge {stat}, per worker rank and node")
                    family = families[stat] = GaugeMetricFamily(_metric_name(stat), doc,
                                                                labels=extra_names + ["rank", "node"])
                family.add_metric(extra + [rank[4:], node], float(value))
            elif extra:  # a replica's own series: labelled replica="i"
                family = families.get(key)
                if family is None:
                    family = families[key] = GaugeMetricFamily(_metric_name(key), _DOCS.get(key, key),
                                                               labels=["replica"])
                family.add_metric(extra, float(value))
            elif key not in families:
                families[key] = GaugeMetricFamily(_metric_name(key), _DOCS.get(key, key), value=float(value))
        return list(families.values())


def _replica_of(key: str) -> tuple[str | None, str]:
    """``replica<i>.<rest>`` -> (``i``, rest); any other key -> (None, key)."""
    head, _, rest = key.partition(".")
    if head.startswith("replica") and head[7:].isdigit() and rest:
        return head[7:], rest
    return None, key


class ServerMetrics:
    def __init__(self, backend: object):
        self.registry = CollectorRegistry()
        self.requests = Counter("mstar_http_requests", "HTTP requests by route, method and status code",
                                ["route", "method", "status"], registry=self.registry)
        self.duration = Histogram("mstar_http_request_duration_seconds",
                                  "End-to-end latency of HTTP requests (until the last byte of a stream)",
                                  ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.first_output = Histogram("mstar_time_to_first_output_seconds",
                                      "Time from a request's arrival to the model's first output",
                                      ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_BackendGauges(backend))

    def render(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)


def _route_of(scope: Scope) -> str:
    route = scope.get("route")
    return getattr(route, "path", None) or _UNMATCHED


class MetricsMiddleware:
    """Counts every HTTP request by route and status and times it end to end."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = scope[_ARRIVAL] = time.perf_counter()
        status = 500  # if the app raises before it starts a response

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = _route_of(scope)  # the router put the matched route into the scope
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()
            self.metrics.duration.labels(route).observe(time.perf_counter() - started)


def observe_first_output(request: Request) -> None:
    """Record the time to first output of ``request`` (call it when the first event came)."""
    metrics: ServerMetrics | None = getattr(request.app.state, "metrics", None)
    arrival = request.scope.get(_ARRIVAL)
    if metrics is not None and arrival is not None:
        metrics.first_output.labels(_route_of(request.scope)).observe(time.perf_counter() - arrival)


async def metrics_endpoint(request: Request) -> Response:
    """``GET /metrics``: the Prometheus text exposition format."""
    return request.app.state.metrics.render()
