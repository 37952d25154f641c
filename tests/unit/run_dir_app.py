"""The API in-process on SQLite with one job of tenant "owner" whose run dir the test writes as the
driver would, and a second tenant "other": what the read routes over run-dir files are tested against."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import select

from api.main import create_app
from api.models import Job, Tenant
from api.settings import Settings
from opd_trainer.storage.run_dir import RunDir

ADMIN = "opd-admin-test-key-0123456789"
Headers = dict[str, str]


@contextmanager
def app_with_job(
    data_dir: Path, job_id: str, write: Callable[[RunDir], None], status: str = "running"
) -> Iterator[tuple[TestClient, Headers, Headers]]:
    """(client, owner's headers, other tenant's headers); `write` fills the job's run dir."""
    app = create_app(Settings(data_dir=data_dir, admin_key=ADMIN, max_concurrent_jobs=0))
    with TestClient(app) as client:
        keys = {}
        for tenant in ("owner", "other"):
            answer = client.post(
                "/v1/keys", json={"tenant": tenant}, headers={"Authorization": f"Bearer {ADMIN}"}
            )
            keys[tenant] = {"Authorization": f"Bearer {answer.json()['key']}"}
        run_dir = data_dir / "runs" / job_id
        run_dir.mkdir(parents=True)
        write(RunDir(run_dir))
        with app.state.db.session() as session:
            owner = session.scalar(select(Tenant).where(Tenant.name == "owner"))
            assert owner is not None
            session.add(
                Job(id=job_id, tenant_id=owner.id, job_name="j", status=status, spec={}, run_dir=str(run_dir))
            )
            session.commit()
        yield client, keys["owner"], keys["other"]
