"""Builds the job server app: settings, database, scheduler, routers, error handlers, middleware. Wiring only.

Launch: `opd serve` (recommended), or `uvicorn --factory api.main:create_app` with `OPD_*` variables.
Hardware: none beyond a CPU; jobs run as Ray actors (embedded local Ray, or `OPD_RAY_ADDRESS`).
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI

from api.db import Database, migrate
from api.errors import install_error_handlers, openapi_with_declared_errors
from api.limits import BodyLimitMiddleware, RateLimitMiddleware, StreamSlots
from api.observability import ServerMetrics
from api.routes import console, files, health, jobs, keys, usage, webhooks
from api.services.keys import AuthCache
from api.services.scheduler import Scheduler
from api.services.webhooks_delivery import Deliverer
from api.settings import Settings, withhold_secrets_from_children
from opd_trainer.jobspec.preflight import import_tokenizer_support


def create_app(settings: Settings | None = None) -> FastAPI:
    if settings is None:
        settings = Settings()
        withhold_secrets_from_children()
    db = Database(settings.sqlalchemy_url)
    metrics = ServerMetrics(db)
    scheduler = Scheduler(settings, db) if settings.scheduler_enabled else None
    deliverer = Deliverer(settings, db)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        for folder in (settings.data_dir, settings.files_dir, settings.workspaces_dir, settings.runs_dir):
            folder.mkdir(parents=True, exist_ok=True)
        migrate(db.engine)
        # Pre-flight's transformers, imported now rather than by the first submission; then everything
        # alive after start-up (transformers, Ray: millions of objects) leaves the garbage collector's
        # view. A full collection walked them all, stalling every request 250-470 ms a few times a
        # minute under 200 pollers (measured with gc.callbacks).
        await anyio.to_thread.run_sync(import_tokenizer_support)
        gc.freeze()
        if scheduler is not None:
            scheduler.start()
        deliverer.start()
        try:
            yield
        finally:
            await deliverer.stop()
            if scheduler is not None:
                scheduler.stop()
            db.engine.dispose()

    app = FastAPI(
        title="OPD trainer job server",
        version="0.1.0",
        description="Submit and watch online policy distillation jobs. Errors: "
        '`{"error": {"code", "message", "param"}}`.',
        lifespan=lifespan,
        # Operation ids are the route functions' names (`create_job`, `list_events`, ...): stable, and
        # what a generated client names its methods.
        generate_unique_id_function=lambda route: route.name,
    )
    app.state.settings = settings
    app.state.db = db
    app.state.metrics = metrics
    app.state.scheduler = scheduler
    app.state.webhook_deliverer = deliverer
    app.state.auth_cache = AuthCache()
    app.state.event_streams = StreamSlots(settings.event_streams_per_tenant)
    for router in (health.router, keys.router, files.router, jobs.router, webhooks.router, usage.router):
        app.include_router(router)
    app.include_router(console.router)  # the web console's static pages (docs/console.md)
    install_error_handlers(app)
    app.openapi = lambda: openapi_with_declared_errors(app)  # type: ignore[method-assign]
    metrics.instrument(app)
    # Added last, so it runs first: nothing reads a body before its size is checked.
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=settings.max_body_bytes,
        max_upload_bytes=settings.max_upload_bytes,
    )
    # Outermost: a request over its key's rate costs no more than its headers.
    if settings.rate_limit_per_s > 0:
        app.add_middleware(
            RateLimitMiddleware, per_s=settings.rate_limit_per_s, burst=settings.rate_limit_burst
        )
    return app
