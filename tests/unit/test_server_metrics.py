"""Prometheus series of the server on a real SQLite file: job ids only for the admin's scrape."""

from __future__ import annotations

from pathlib import Path

from api.db import Database, migrate
from api.models import Job, Tenant
from api.observability import ServerMetrics


def _server_with_a_running_job(tmp_path: Path) -> ServerMetrics:
    db = Database(f"sqlite:///{tmp_path / 'opd.db'}")
    migrate(db.engine)
    with db.session() as session:
        session.add(Tenant(id="tenant-1", name="acme"))
        session.flush()  # the jobs' foreign key needs the tenant row first
        session.add(
            Job(
                id="opdjob-secret-id",
                tenant_id="tenant-1",
                job_name="j",
                status="running",
                spec={},
                run_dir=str(tmp_path / "run"),
                step=3,
                total_steps=10,
                trained_tokens=1200.0,
                metrics={
                    "reverse_kl": 0.25,
                    "pool/reward:judge/workers": 2.0,
                    "pool/reward:judge/workers_replaced": 1.0,
                    "engine/student/generation_tokens": 5120.0,
                    "engine/teacher/kv_cache_usage_max": 0.25,
                    "engine/teacher/unknown_key": 1.0,
                },
            )
        )
        session.add(
            Job(id="opdjob-queued", tenant_id="tenant-1", job_name="q", status="queued", spec={}, run_dir="")
        )
        session.commit()
    return ServerMetrics(db)


def test_public_scrape_counts_jobs_without_naming_any(tmp_path: Path) -> None:
    text = _server_with_a_running_job(tmp_path).render().decode()
    assert 'opd_jobs{status="running"} 1.0' in text and "opd_queue_depth 1.0" in text
    assert "opdjob-" not in text and "job_id" not in text


def test_admin_scrape_adds_each_running_jobs_progress(tmp_path: Path) -> None:
    text = _server_with_a_running_job(tmp_path).render(include_jobs=True).decode()
    assert 'opd_jobs{status="running"} 1.0' in text
    assert 'opd_job_step{job_id="opdjob-secret-id"} 3.0' in text
    assert 'opd_job_reverse_kl{job_id="opdjob-secret-id"} 0.25' in text
    assert 'opd_job_pool_workers{job_id="opdjob-secret-id",pool="reward:judge"} 2.0' in text
    assert 'opd_job_pool_workers_replaced_total{job_id="opdjob-secret-id",pool="reward:judge"} 1.0' in text
    assert 'opd_job_trained_tokens_total{job_id="opdjob-secret-id"} 1200.0' in text
    assert 'opd_job_engine_generation_tokens_total{job_id="opdjob-secret-id",role="student"} 5120.0' in text
    assert 'opd_job_engine_kv_cache_usage_max{job_id="opdjob-secret-id",role="teacher"} 0.25' in text
    assert "unknown_key" not in text
    assert "opdjob-queued" not in text
