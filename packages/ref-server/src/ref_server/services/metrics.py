"""The router's Prometheus metrics (served at `/metrics` on its HTTP port)."""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram(
            "ref_server_time_to_first_token_seconds",
            "request start to first token",
            buckets=buckets,
            registry=r,
        )
        self.tpot = Histogram(
            "ref_server_time_per_output_token_seconds",
            "mean gap between later tokens of a request",
            buckets=buckets,
            registry=r,
        )
        self.requests = Counter(
            "ref_server_requests", "ended requests, by outcome", ["outcome"], registry=r
        )
        self.aborts = Counter(
            "ref_server_pd_aborts",
            "requests aborted or cancelled, by the stage they were in (prefill, handoff, decode)",
            ["stage"],
            registry=r,
        )
        self.prompt_tokens = Counter("ref_server_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "ref_server_cached_tokens", "prompt tokens from the prefix cache", registry=r
        )
        self.predicted_cached_tokens = Counter(
            "ref_server_predicted_cached_tokens",
            "prompt tokens the router's prefix index expected to find cached",
            registry=r,
        )
        self.prefill_routes = Counter(
            "ref_server_prefill_routes",
            "prefill instances chosen, by the rule that chose (prefix: its cached prefix, "
            "load: the least queued)",
            ["rule"],
            registry=r,
        )
        self.output_tokens = Counter("ref_server_output_tokens", "generated tokens", registry=r)
        self.transfer_bytes = Counter(
            "ref_server_kv_transfer_bytes",
            "KV bytes moved prefill to decode, by method (grpc or cuda_ipc)",
            ["method"],
            registry=r,
        )
        self.transfer_failures = Counter(
            "ref_server_kv_transfer_failures", "KV transfers that failed", registry=r
        )
        self.tokens_per_s = Gauge(
            "ref_server_output_tokens_per_second",
            "generated tokens/s over the last 10 s",
            registry=r,
        )
        self.inflight = Gauge("ref_server_requests_in_flight", "admitted requests", registry=r)
        self.waiting = Gauge(
            "ref_server_worker_waiting", "requests waiting in a worker", ["worker"], registry=r
        )
        self.running = Gauge(
            "ref_server_worker_running", "requests running in a worker", ["worker"], registry=r
        )
        self.kv_usage = Gauge(
            "ref_server_worker_kv_usage",
            "share of a worker's KV pages in use",
            ["worker"],
            registry=r,
        )
        self.expert_rebalances = Gauge(
            "ref_server_worker_expert_rebalances",
            "expert placements the worker computed since it started (--eplb-interval)",
            ["worker"],
            registry=r,
        )
        self.expert_bytes_moved = Gauge(
            "ref_server_worker_expert_bytes_moved",
            "expert weight bytes the worker moved into new slots since it started",
            ["worker"],
            registry=r,
        )
        self.draft_acceptance_rate = Gauge(
            "ref_server_worker_draft_acceptance_rate",
            "share of the MTP module's draft tokens the worker accepted since it started "
            "(--speculative mtp)",
            ["worker"],
            registry=r,
        )
        self.accepted_length = Gauge(
            "ref_server_worker_accepted_length",
            "tokens a sequence got from a step that verified its drafts, on average since the "
            "worker started (--speculative mtp)",
            ["worker"],
            registry=r,
        )
        self.ranks = Gauge(
            "ref_server_worker_ranks",
            "ranks the worker's instance serves with now: fewer than it started with "
            "(ref_server_worker_configured_ranks) once an elastic instance lost some",
            ["worker"],
            registry=r,
        )
        self.configured_ranks = Gauge(
            "ref_server_worker_configured_ranks",
            "ranks the worker's instance started with",
            ["worker"],
            registry=r,
        )
        self.healthy = Gauge(
            "ref_server_worker_healthy",
            "1 if the router routes to the worker",
            ["worker"],
            registry=r,
        )
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_tokens = 0  # the sum over _recent, kept as it changes: this runs per chunk
        self._lock = threading.Lock()
        self.tokens_per_s.set_function(self._tokens_per_s)  # read when scraped: never stale

    def count_output(self, tokens: int) -> None:
        self.output_tokens.inc(tokens)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, tokens))
            self._recent_tokens += tokens
            self._forget_before(now - 10)

    def _tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._forget_before(now - 10)
            if not self._recent:
                return 0.0
            return self._recent_tokens / max(now - self._recent[0][0], 1.0)

    def _forget_before(self, start: float) -> None:
        while self._recent and self._recent[0][0] < start:
            self._recent_tokens -= self._recent.popleft()[1]

    def show_workers(self, workers) -> None:
        for w in workers:
            self.healthy.labels(w.name).set(int(w.routable))
            self.waiting.labels(w.name).set(w.load.waiting)
            self.running.labels(w.name).set(w.load.running)
            self.kv_usage.labels(w.name).set(w.load.kv_usage)
            self.expert_rebalances.labels(w.name).set(w.load.expert_rebalances)
            self.expert_bytes_moved.labels(w.name).set(w.load.expert_bytes_moved)
            self.draft_acceptance_rate.labels(w.name).set(w.load.draft_acceptance_rate)
            self.accepted_length.labels(w.name).set(w.load.accepted_length)
            self.ranks.labels(w.name).set(w.load.ranks)
            self.configured_ranks.labels(w.name).set(w.load.configured_ranks)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
