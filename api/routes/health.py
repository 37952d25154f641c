"""Health, readiness (database and Ray reachable) and Prometheus metrics; no key needed."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from api.db import ping
from api.deps import DatabaseDep, SchedulerDep
from api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(db: DatabaseDep, scheduler: SchedulerDep) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        await run_in_threadpool(ping, db.engine)
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    checks["ray"] = "disabled (max_concurrent_jobs=0)" if scheduler is None else scheduler.ray_status
    ready = checks["database"] == "ok" and (scheduler is None or scheduler.ray_status == "ok")
    body = Health(status="ok" if ready else "unavailable", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(request: Request) -> Response:
    payload = await run_in_threadpool(request.app.state.metrics.render)
    return Response(payload, media_type=CONTENT_TYPE_LATEST)
