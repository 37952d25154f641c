"""Prometheus metrics of the server: jobs by status, queue depth, per-job training gauges, per-tenant usage,
request latency.

Job numbers are read from the database at scrape time (one query), so they are right after a restart
and need no bookkeeping; request latency is a histogram labelled by route template, not raw path, so
ids do not explode the label set. Series labelled by job id or tenant (`opd_tenant_*_total`, what each
tenant's jobs used) are rendered only for a scrape that presents the admin key: anyone may see how
busy the server is, not which jobs it runs or who uses it.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator.metrics import latency
from sqlalchemy import func, select

from api.db import Database
from api.models import Job
from api.services.states import WITH_DRIVER
from api.services.usage import tenant_usage
from opd_trainer.jobspec.job_status import JobStatus

STATUSES: tuple[str, ...] = tuple(JobStatus)
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


# Per pool (`pool/NAME/KEY` in a job's metrics): gauges, and running totals exported as counters.
POOL_GAUGES = {
    "workers": "Live workers of the pool.",
    "workers_desired": "Workers the pool's autoscaler wants.",
    "in_flight": "Calls running on the pool's workers.",
    "queued": "Calls waiting for a free worker slot.",
    "utilisation": "(in-flight + queued calls) / (workers x concurrency).",
}
POOL_COUNTERS = {
    "workers_replaced": "Workers replaced (died, or killed for a timeout or memory).",
    "calls_retried": "Calls sent again after their worker died.",
    "scale_ups": "Autoscaler scale-up decisions.",
    "scale_downs": "Autoscaler scale-down decisions.",
}


# Per engine role (`engine/ROLE/KEY` in a job's metrics, from vLLM's stat logger: engine/engine_stats.py).
ENGINE_GAUGES = {
    "running_max": "Most requests running at once on the role's engines during the latest step.",
    "waiting_max": "Most requests waiting at once on the role's engines during the latest step.",
    "kv_cache_usage_max": "Highest KV-cache usage (0-1) of a replica of the role during the latest step.",
    "prefix_cache_hit_rate": "Prefix-cache hits over queried prompt tokens so far.",
}
ENGINE_COUNTERS = {
    "prompt_tokens": "Prompt tokens the role's engines processed.",
    "generation_tokens": "Tokens the role's engines generated.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "preemptions": "Requests preempted (KV cache full).",
    "requests_finished": "Requests the role's engines finished.",
    "scores_rescored": "Scoring requests rerun without the prefix cache (it held part of the completion).",
    "scores_reused": "Scoring requests whose completion positions the prefix cache hid took an earlier "
    "request's rows for the same tokens (no rerun).",
}


def _families(
    group: str, label: str, gauges: dict[str, str], counters: dict[str, str]
) -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    """`opd_job_GROUP_KEY{job_id, label}`: a gauge per `gauges` key, a counter per `counters` key."""
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for kind, texts in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
        for key, help_text in texts.items():
            families[key] = kind(f"opd_job_{group}_{key}", help_text, labels=["job_id", label])
    return families


class JobProgressCollector(Collector):
    """Per running job, labelled by job id: steps, tokens, the latest step's metrics, its pools and
    engines."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self.db.session() as session:
            running = session.scalars(select(Job).where(Job.status.in_(WITH_DRIVER))).all()
        step = GaugeMetricFamily("opd_job_step", "Steps done.", labels=["job_id"])
        total = GaugeMetricFamily("opd_job_total_steps", "Steps planned.", labels=["job_id"])
        tokens = CounterMetricFamily(
            "opd_job_trained_tokens", "Completion tokens trained so far.", labels=["job_id"]
        )
        gauges = {
            key: GaugeMetricFamily(f"opd_job_{key}", help_text, labels=["job_id"])
            for key, help_text in JOB_GAUGES.items()
        }
        # `GROUP/NAME/KEY` metrics of a job: the family of KEY, labelled by job id and NAME.
        grouped = {
            "pool": _families("pool", "pool", POOL_GAUGES, POOL_COUNTERS),
            "engine": _families("engine", "role", ENGINE_GAUGES, ENGINE_COUNTERS),
        }
        for job in running:
            step.add_metric([job.id], job.step)
            total.add_metric([job.id], job.total_steps or 0)
            tokens.add_metric([job.id], job.trained_tokens)
            for key, gauge in gauges.items():
                if key in job.metrics:
                    gauge.add_metric([job.id], job.metrics[key])
            for name, value in job.metrics.items():
                parts = name.split("/")
                if len(parts) != 3 or parts[0] not in grouped or value is None:
                    continue
                family = grouped[parts[0]].get(parts[2])
                if family is not None:
                    family.add_metric([job.id, parts[1]], value)
        yield from (step, total, tokens, *gauges.values())
        for families in grouped.values():
            yield from families.values()


# Per tenant, from each job's usage (`driver/metering.py`) added up, deleted jobs included.
TENANT_COUNTERS = {
    "teacher_tokens": "Tokens the teacher engines processed for the tenant's jobs.",
    "teacher_cached_tokens": "Of the teacher's tokens, prefix-cache hits.",
    "student_generated_tokens": "Tokens the student engines generated for the tenant's jobs.",
    "learner_tokens_trained": "Completion tokens the learner trained on.",
    "processor_calls": "Calls of the tenant's rollout, reward and evaluator processors.",
    "processor_seconds": "Seconds those calls took.",
    "cpu_s": "CPU-seconds of every role of the tenant's jobs.",
    "gpu_s": "GPU-seconds (GPUs held x seconds) of the tenant's jobs.",
    "wall_s": "Seconds the tenant's job drivers ran.",
}


class TenantUsageCollector(Collector):
    """`opd_tenant_KEY_total{tenant}`: what each tenant's jobs used so far."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[CounterMetricFamily]:
        with self.db.session() as session:
            tenants = tenant_usage(session, None)
        for key, help_text in TENANT_COUNTERS.items():
            family = CounterMetricFamily(f"opd_tenant_{key}", help_text, labels=["tenant"])
            for entry in tenants:
                family.add_metric([entry.tenant], entry.usage.get(key, 0.0))
            yield family


class ServerMetrics:
    """The app's own registry (not the global one), so several apps can live in one process."""

    def __init__(self, db: Database) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(JobCountCollector(db))
        self.job_registry = CollectorRegistry()
        self.job_registry.register(JobProgressCollector(db))
        self.job_registry.register(TenantUsageCollector(db))

    def instrument(self, app: FastAPI) -> None:
        """Request latency, `opd_http_request_duration_seconds{handler,method,status}` by route template
        (prometheus-fastapi-instrumentator's pure ASGI middleware: streams pass through untouched)."""
        Instrumentator(
            should_group_status_codes=False, should_group_untemplated=True, registry=self.registry
        ).add(
            latency(
                metric_namespace="opd",
                metric_doc="Request latency by route template.",
                buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2.5, 5, 10),
                registry=self.registry,
            )
        ).instrument(app)

    def render(self, include_jobs: bool = False) -> bytes:
        """The public series; with `include_jobs` (the admin's scrape) also those labelled by job id."""
        payload = generate_latest(self.registry)
        return payload + generate_latest(self.job_registry) if include_jobs else payload
