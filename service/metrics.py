"""Prometheus metrics of the gateway (own registry, no module-level collectors).

With several worker processes (``xmark serve --workers N``) every process writes its samples to
files under ``PROMETHEUS_MULTIPROC_DIR`` and ``/metrics``, whichever process answers it, reports
the sum over all of them (prometheus-client's multiprocess mode).
"""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """Collectors: requests, latency, tokens generated, generations, record failures, trace verdicts."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "xmark_http_requests",
            "HTTP requests by route template, method and status code.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "xmark_http_request_duration_seconds",
            "HTTP request latency by route template (until the response is complete).",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens_generated = Counter(
            "xmark_tokens",
            "Tokens processed by a served model's backend (kind=prompt|completion; embedding: /v1/embeddings inputs).",
            ["kind", "model"],
            registry=self.registry,
        )
        self.generations = Counter(
            "xmark_generations",
            "Completed generations by finish reason and served model.",
            ["finish_reason", "model"],
            registry=self.registry,
        )
        # generation records: spooled when the database does not take them, drained into it
        # later; dropped only when the spool fails too (each is logged; alert on any)
        self.generation_records_spooled = Counter(
            "xmark_generation_records_spooled",
            "Generation rows written to the local spool because the database did not take them.",
            registry=self.registry,
        )
        self.generation_records_drained = Counter(
            "xmark_generation_records_drained",
            "Spooled generation rows written into the database.",
            registry=self.registry,
        )
        self.generation_records_dropped = Counter(
            "xmark_generation_records_dropped",
            "Generation rows neither the database nor the spool took, or the database refused; each is logged.",
            registry=self.registry,
        )
        self.generation_records_waiting = Gauge(
            "xmark_generation_records_spool_rows",
            "Generation rows waiting in the local spool (the spool file is shared by a host's processes).",
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.database_unavailable = Counter(
            "xmark_database_unavailable",
            "Requests answered 503 database_unavailable (the database was down, hung or saturated).",
            registry=self.registry,
        )
        self.trace_verdicts = Counter(
            "xmark_trace_verdicts",
            "Trace requests by verdict and whether a user was attributed.",
            ["verdict", "attributed"],
            registry=self.registry,
        )
        self.trace_decoders = Counter(
            "xmark_trace_decoders",
            "Trace requests by the decoder that decided (counting or likelihood).",
            ["decoder"],
            registry=self.registry,
        )
        self.admission_refusals = Counter(
            "xmark_admission_refusals",
            "Chat requests refused with 429, by the limit reached "
            "(queue, max_parallel_requests, requests_per_minute, tokens_per_minute, "
            "end_user_requests_per_minute, end_user_tokens_per_minute).",
            ["limit"],
            registry=self.registry,
        )
        self.admission_redis_errors = Counter(
            "xmark_admission_redis_errors",
            "Redis calls of the admission limits that failed or timed out.",
            registry=self.registry,
        )
        self.admission_redis_fallbacks = Counter(
            "xmark_admission_redis_fallbacks",
            "Admission decisions made with this process's own counters because Redis was unavailable.",
            registry=self.registry,
        )
        # failed authentication per client address (service/services/auth_edge.py)
        self.auth_key_reads = Counter(
            "xmark_auth_key_reads",
            "Database reads of an API key by authentication (a cache miss), by result (accepted|refused).",
            ["result"],
            registry=self.registry,
        )
        self.auth_edge_refusals = Counter(
            "xmark_auth_edge_refusals",
            "Requests refused 401 without a database read because their client address was backed off.",
            registry=self.registry,
        )
        self.auth_edge_backoffs = Counter(
            "xmark_auth_edge_backoffs",
            "Back-offs of a client address started by this process (its failed authentications passed the budget).",
            registry=self.registry,
        )
        self.auth_edge_redis_errors = Counter(
            "xmark_auth_edge_redis_errors",
            "Redis calls of the per-address authentication budget that failed or timed out "
            "(the decision was made with this process's own counts).",
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The Prometheus text exposition: this registry, or every process's in multiprocess mode."""
        if os.environ.get(MULTIPROCESS_DIR_ENV):
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            return generate_latest(merged)
        return generate_latest(self.registry)
