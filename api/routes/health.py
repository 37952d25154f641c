"""Health, readiness (the database; Ray too on the replica that schedules) and Prometheus metrics.

No key needed.

`/metrics` with the admin key as bearer token adds the series labelled by job id.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from api.db import ping
from api.deps import Credentials, DatabaseDep, SchedulerDep, SettingsDep
from api.errors import errors
from api.services import keys
from opd_trainer.wire.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, responses=errors(database=False))
def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}, **errors(database=False)})
async def readyz(db: DatabaseDep, scheduler: SchedulerDep) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        await run_in_threadpool(ping, db.engine)
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    if scheduler is None:
        checks["ray"] = "disabled (max_concurrent_jobs=0)"
    else:
        checks["ray"] = scheduler.ray_status
        checks["scheduler"] = scheduler.role
    ready = checks["database"] == "ok" and (scheduler is None or scheduler.ready)
    body = Health(status="ok" if ready else "unavailable", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, **errors(database=False)},
)
async def metrics(request: Request, settings: SettingsDep, credentials: Credentials) -> Response:
    admin = settings.admin_key.get_secret_value() if settings.admin_key else None
    include_jobs = credentials is not None and keys.is_admin(credentials.credentials, admin)
    payload = await run_in_threadpool(request.app.state.metrics.render, include_jobs)
    return Response(payload, media_type=CONTENT_TYPE_LATEST)
