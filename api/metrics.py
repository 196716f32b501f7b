"""Prometheus metrics of one app instance (its own registry, so tests can build many apps)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"})
"""The method labels: any other token a client sends counts as `other` (each would be series kept for good)."""


class Metrics:
    """Requests and latency by route and status, solve time by solver, lb of the last placements."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "eplb_http_requests", "HTTP requests by route, method and status", ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "eplb_http_request_duration_seconds", "HTTP request latency by route", ["route", "method"],
            registry=self.registry,
        )
        self.solve_time = Histogram(
            "eplb_solve_duration_seconds", "Wall time of a placement solve by solver", ["solver"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        self.last_lb = Gauge(
            "eplb_last_placement_lb", "lb (max / mean GPU load) of the last placement, over its layers",
            ["stat", "solver"], registry=self.registry,
        )
        self.last_baseline_lb = Gauge(
            "eplb_last_baseline_lb", "lb of the no-EPLB baseline on the last placement's window, over its layers",
            ["stat"], registry=self.registry,
        )

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        method = method if method in METHODS else "other"
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, method).observe(seconds)

    def solved(self, solver: str, seconds: float, lb: tuple[float, float, float, float] | None) -> None:
        """One placement solved, wherever the service solved it (POST /placement, its jobs, a deployment's windows:
        `api.convert.timed_solve` times them all); lb: (mean, max) over layers of the placement, then of the
        baseline."""
        self.solve_time.labels(solver).observe(seconds)
        if lb is not None:
            self.last_lb.labels("mean", solver).set(lb[0])
            self.last_lb.labels("max", solver).set(lb[1])
            self.last_baseline_lb.labels("mean").set(lb[2])
            self.last_baseline_lb.labels("max").set(lb[3])

    def render(self) -> str:
        return generate_latest(self.registry).decode()
