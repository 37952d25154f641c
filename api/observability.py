"""Prometheus metrics of the server: jobs by status, queue depth, per-job training gauges, request latency.

Job numbers are read from the database at scrape time (one query), so they are right after a restart
and need no bookkeeping; request latency is a histogram labelled by route template, not raw path, so
ids do not explode the label set. Series labelled by job id are rendered only for a scrape that presents
the admin key: anyone may see how busy the server is, not which jobs it runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.db import Database
from api.models import Job
from api.schemas import JobStatus
from api.services.states import WITH_DRIVER

STATUSES: tuple[str, ...] = JobStatus.__args__  # type: ignore[attr-defined]
JOB_GAUGES = {
    "reverse_kl": "Per-token reverse KL to the teacher at the latest step.",
    "reward_mean": "Mean task reward at the latest step.",
    "tokens_per_s": "Trained tokens per second at the latest step.",
}


class JobCountCollector(Collector):
    """Jobs by status and the queue depth: no job ids."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.db.session() as session:
            counts = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
        by_status = GaugeMetricFamily("opd_jobs", "Jobs by status.", labels=["status"])
        for status in STATUSES:
            by_status.add_metric([status], counts.get(status, 0))
        yield by_status
        yield GaugeMetricFamily(
            "opd_queue_depth", "Jobs waiting for a driver.", value=counts.get("queued", 0)
        )


class JobProgressCollector(Collector):
    """Per running job, labelled by job id: steps, tokens, the latest step's metrics, pool sizes."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.db.session() as session:
            running = session.scalars(select(Job).where(Job.status.in_(WITH_DRIVER))).all()
        step = GaugeMetricFamily("opd_job_step", "Steps done.", labels=["job_id"])
        total = GaugeMetricFamily("opd_job_total_steps", "Steps planned.", labels=["job_id"])
        tokens = GaugeMetricFamily(
            "opd_job_trained_tokens", "Completion tokens trained so far.", labels=["job_id"]
        )
        gauges = {
            key: GaugeMetricFamily(f"opd_job_{key}", help_text, labels=["job_id"])
            for key, help_text in JOB_GAUGES.items()
        }
        pools = GaugeMetricFamily(
            "opd_job_pool_workers", "Workers per processor pool.", labels=["job_id", "pool"]
        )
        for job in running:
            step.add_metric([job.id], job.step)
            total.add_metric([job.id], job.total_steps or 0)
            tokens.add_metric([job.id], job.trained_tokens)
            for key, gauge in gauges.items():
                if key in job.metrics:
                    gauge.add_metric([job.id], job.metrics[key])
            for name, value in job.metrics.items():
                if name.startswith("pool/") and name.endswith("/workers"):
                    pools.add_metric([job.id, name.split("/")[1]], value)
        yield from (step, total, tokens, *gauges.values(), pools)


class ServerMetrics:
    """The app's own registry (not the global one), so several apps can live in one process."""

    def __init__(self, db: Database) -> None:
        self.registry = CollectorRegistry()
        self.request_seconds = Histogram(
            "opd_http_request_duration_seconds",
            "Request latency by route template.",
            ["method", "route", "status"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2.5, 5, 10),
        )
        self.registry.register(JobCountCollector(db))
        self.job_registry = CollectorRegistry()
        self.job_registry.register(JobProgressCollector(db))

    def render(self, include_jobs: bool = False) -> bytes:
        """The public series; with `include_jobs` (the admin's scrape) also those labelled by job id."""
        payload = generate_latest(self.registry)
        return payload + generate_latest(self.job_registry) if include_jobs else payload


class LatencyMiddleware:
    """Times every HTTP request (pure ASGI: streaming responses pass through untouched)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: dict[str, Any] = {"code": 500}

        async def send_and_record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.request_seconds.labels(scope["method"], template, str(status["code"])).observe(
                time.perf_counter() - started
            )
