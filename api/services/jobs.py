"""Jobs: submission with pre-flight, listing, user transitions, and the run's records (events, metrics, ...).

Pre-flight runs inside the submit request and never imports user code: the spec is validated by the
engine's own `JobSpec`, every file id is resolved to a file this tenant owns with the right purpose,
each processor's classpath is checked statically against its extracted workspace, and the student's
and teacher's tokenizers are compared. A job that passes is stored `queued` and the scheduler takes it
from there.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from api.errors import APIError, not_found
from api.models import File, Job, JobEvent
from api.services import model_files, server_paths, webhooks
from api.services.ids import new_id
from api.services.states import ACTIVE, TERMINAL, next_status
from api.services.usage import keep_usage_of_deleted
from api.settings import Settings
from opd_trainer.driver.estimate import calibration_spec, estimate_from_records, steps_to_calibrate
from opd_trainer.driver.trackers import check_tracking_uri
from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.job_spec import JobSpec
from opd_trainer.jobspec.job_status import JobStatus, format_event_line
from opd_trainer.jobspec.lora_check import preflight_lora
from opd_trainer.jobspec.memory_plan import check_memory_plan, placement_budget
from opd_trainer.jobspec.model_source import is_hub_id, local_model
from opd_trainer.jobspec.preflight import preflight_models
from opd_trainer.learner.merged_models import is_adapter_folder, merged_folder, whole_model
from opd_trainer.storage.run_dir import RunDir
from opd_trainer.wire.schemas import (
    CheckpointList,
    CheckpointPublic,
    EventList,
    EventPublic,
    JobCreate,
    JobList,
    JobPublic,
    MetricsPublic,
)
from opd_trainer.workers.classpath import validate_workspace
from opd_trainer.workers.requirements import requirements_of

# -- helpers shared with the scheduler --------------------------------------------------------------


def add_event(
    session: Session,
    job_id: str,
    kind: str,
    message: str,
    data: dict[str, Any] | None = None,
    *,
    at: float | None = None,
) -> None:
    """Records one event; `at` keeps a driver event's own time."""
    session.add(JobEvent(job_id=job_id, time=at or time.time(), type=kind, message=message, data=data or {}))


def compare_and_set(session: Session, job_id: str, expected: str, new: str, **fields: Any) -> bool:
    """Moves `job_id` from `expected` to `new` only if nobody moved it meanwhile (API vs scheduler), and
    writes the webhook deliveries of the move in the same transaction."""
    if new in TERMINAL:
        fields.setdefault("finished_at", int(time.time()))
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == expected)
        .values(status=new, **fields)
        .execution_options(synchronize_session=False)
    )
    if not result.rowcount:  # type: ignore[attr-defined]
        return False
    webhooks.enqueue(session, job_id, new)  # the outbox: committed with the status change, or not at all
    return True


def status_since(session: Session, job_id: str, status: str) -> float | None:
    """When `job_id` last moved to `status` (the time of its status event: the user's request for
    `cancelling` / `pausing`), None if no event says so. The scheduler's cancel bound counts from it,
    so it holds across a server restart or a change of scheduling replica."""
    recent = session.scalars(
        select(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.type == "status")
        .order_by(JobEvent.id.desc())
        .limit(20)
    )
    return next((e.time for e in recent if (e.data or {}).get("status") == status), None)


def public(job: Job) -> JobPublic:
    found = JobPublic.model_validate(job)
    run_dir = RunDir(job.run_dir)
    if found.dry_run is not None:  # a calibration: what it trained is not a model to hand out
        if job.status == JobStatus.SUCCEEDED:
            found.dry_run.estimate = _estimate(job, run_dir)
    else:
        found.promotion = run_dir.promoted()
        found.best_checkpoint = found.promotion.checkpoint if found.promotion is not None else None
        if job.status == JobStatus.SUCCEEDED:
            found.fine_tuned_model = run_dir.fine_tuned_model_id()
    if found.error is not None:
        found.error.message = server_paths.public_text(found.error.message, server_paths.data_dir_of(job))
    return found


def _estimate(job: Job, run_dir: RunDir) -> dict[str, Any] | None:
    """A succeeded dry run's estimate of the whole job (`driver/estimate.py`), from its records."""
    assert job.dry_run is not None
    try:
        return estimate_from_records(
            run_dir.records(), JobSpec.model_validate(job.spec), job.dry_run["total_steps"]
        )
    except ValueError:  # no training record: nothing to scale
        return None


def get_owned(session: Session, tenant_id: str, job_id: str, param: str = "job_id") -> Job:
    job = session.scalar(select(Job).where(Job.id == job_id))
    if job is None or job.tenant_id != tenant_id:
        raise not_found("job", job_id, param)
    return job


# -- submission -------------------------------------------------------------------------------------


def _local_path_error(param: str, what: str) -> APIError:
    return APIError(
        400,
        "file_id_required",
        f"the server does not read local paths: upload the {what} (POST /v1/files) and pass its file id",
        param,
    )


def _owned_file(session: Session, tenant_id: str, ident: str, purpose: str, param: str) -> File:
    record = session.get(File, ident)
    if record is None or record.tenant_id != tenant_id:
        if "/" in ident or "\\" in ident or ident.endswith((".jsonl", ".zip")):
            raise _local_path_error(param, "dataset" if purpose == "dataset" else "workspace zip")
        raise not_found("file", ident, param)
    if record.purpose != purpose:
        raise APIError(
            400, "wrong_file_purpose", f"file {ident} is a {record.purpose}, not a {purpose}", param
        )
    return record


def resolve_files(session: Session, tenant_id: str, spec: JobSpec) -> tuple[JobSpec, list[File]]:
    """The spec with file ids replaced by server paths (datasets → file, workspace → extracted dir)."""
    used: list[File] = []

    def datasets(field: str, idents: list[str]) -> list[str]:
        records = [
            _owned_file(session, tenant_id, d, "dataset", f"{field}.{i}") for i, d in enumerate(idents)
        ]
        used.extend(records)
        return [r.path for r in records]

    functions = []
    for component in spec.functions:
        fcmodel = component.fcmodel
        if fcmodel.workspace is None:
            raise _local_path_error(f"functions.{component.name}.fcmodel.zipdir", "workspace zip")
        record = _owned_file(
            session,
            tenant_id,
            fcmodel.workspace,
            "workspace",
            f"functions.{component.name}.fcmodel.workspace",
        )
        used.append(record)
        local = fcmodel.model_copy(update={"zipdir": record.extracted_dir, "workspace": None})
        functions.append(component.model_copy(update={"fcmodel": local}))
    resolved = spec.model_copy(
        update={
            "training_datasets": datasets("training_datasets", spec.training_datasets),
            "validation_datasets": datasets("validation_datasets", spec.validation_datasets),
            "functions": functions,
        }
    )
    return resolved, used


def check_model_access(session: Session, settings: Settings, tenant_id: str, spec: JobSpec) -> None:
    """`model` / `teacher_model` may name only folders under an operator-approved model directory
    (`OPD_MODEL_DIRS`) or inside one of this tenant's own jobs (its checkpoints, by path or as
    `<job id>/checkpoints/<id>/student`).

    Checked before anything looks at the path, with one message whether or not the path exists, so the
    answer reveals nothing about the server's filesystem or other tenants' jobs.
    """
    own_jobs = session.execute(select(Job.id, Job.run_dir).where(Job.tenant_id == tenant_id)).all()
    roots = [*settings.approved_model_dirs, *(Path(run_dir) for _, run_dir in own_jobs if run_dir)]
    for field, value in spec.weight_sources().items():
        checkpoint = server_paths.CHECKPOINT_MODEL.fullmatch(value)
        if checkpoint is not None:
            if any(job_id == checkpoint["job"] for job_id, _ in own_jobs):
                continue
        elif is_hub_id(value) or value.startswith("file-"):
            continue  # the hub cache, or the tenant's own upload (`resolve_models`)
        else:
            path = Path(value)
            # resolve() follows symlinks, so a link inside an approved folder cannot point out of it.
            if path.is_absolute() and any(path.resolve().is_relative_to(root.resolve()) for root in roots):
                continue
        raise APIError(
            400,
            "model_not_allowed",
            f"{field} {value!r} is not an approved model: use a folder under the server's model "
            "directories (OPD_MODEL_DIRS), a checkpoint of one of your own jobs "
            "(<job id>/checkpoints/<checkpoint id>/student), or a Hugging Face id (org/name) in the "
            "server's hub cache",
            field,
        )


def resolve_models(session: Session, tenant_id: str, spec: JobSpec) -> tuple[JobSpec, list[File]]:
    """Uploaded models (file ids) replaced by their extracted folders, checkpoints of the tenant's
    jobs by their folders, Hugging Face ids by their snapshot folders in the server's hub cache (never
    fetched); paths stay."""
    updates: dict[str, str] = {}
    used: list[File] = []
    for field, value in spec.weight_sources().items():
        checkpoint = server_paths.CHECKPOINT_MODEL.fullmatch(value)
        if checkpoint is not None:
            source = get_owned(session, tenant_id, checkpoint["job"], field)
            # A LoRA job's checkpoint holds an adapter: a later job trains and serves its merged model.
            updates[field] = whole_model(str(Path(source.run_dir) / checkpoint["folder"]))
        elif value.startswith("file-"):
            record = _owned_file(session, tenant_id, value, "model", field)
            assert record.extracted_dir is not None  # the upload extracted it
            used.append(record)
            updates[field] = record.extracted_dir
        else:
            updates[field] = local_model(value, field, download=False)
    return spec.with_weight_sources(updates), used


def preflight(resolved: JobSpec) -> None:
    """Static checks on the resolved spec; raises `ConfigError` naming the field. Its messages name
    server paths: `create` passes them through `server_paths.public_text`."""
    for component in resolved.functions:
        assert component.fcmodel.zipdir is not None  # resolve_files put the extracted dir there
        problems = validate_workspace(Path(component.fcmodel.zipdir), component.fcmodel.classpath)
        if problems:
            raise ConfigError("; ".join(problems), field=f"functions.{component.name}.fcmodel.classpath")
        # Package specifiers only (no pip options, paths or URLs): refused here, not when a worker starts.
        requirements_of(Path(component.fcmodel.zipdir), f"functions.{component.name}.fcmodel.workspace")
    for field, value in resolved.weight_sources().items():
        # Only local model folders: a hub name would make transformers try the network from the API.
        if not Path(value).is_dir():
            raise ConfigError(f"model folder {value} not found on the server", field=field)
    max_length = preflight_models(resolved.hyper_parameters.max_length, resolved.weight_sources())
    # Each role's memory against this node's (or, on a Ray cluster of several nodes, the largest's):
    # its whole memory, since a queued job starts once the jobs before it have freed theirs; the driver
    # checks again against what is available when the job starts.
    budget = placement_budget()
    check_memory_plan(resolved, max_length, dataclasses.replace(budget, host_available=budget.host_total))
    preflight_lora(resolved.hyper_parameters.lora_targets(), resolved.model)


def create(
    session: Session, settings: Settings, tenant_id: str, body: JobCreate, dry_run: bool = False
) -> JobPublic:
    """A new queued job after pre-flight; `dry_run`: a calibration of its first steps instead, whose
    estimate of the whole job the job shows once it succeeded (`driver/estimate.py`)."""
    spec = JobSpec.model_validate(body.model_dump())
    active = session.scalar(
        select(func.count()).select_from(Job).where(Job.tenant_id == tenant_id, Job.status.in_(ACTIVE))
    )
    if (active or 0) >= settings.tenant_max_active_jobs:
        raise APIError(
            429,
            "job_limit_reached",
            f"tenant already has {active} unfinished jobs (limit {settings.tenant_max_active_jobs})",
        )
    check_model_access(session, settings, tenant_id, spec)
    check_tracking_uri(spec.mlflow_tracking_uri, settings.tracker_allowed_uris)
    with_models, models_used = resolve_models(session, tenant_id, spec)
    resolved, used = resolve_files(session, tenant_id, with_models)
    used += models_used
    # Before transformers opens a tenant's folder in this process: bounded files, no custom code.
    model_files.check_models(resolved.weight_sources(), settings.model_max_tokenizer_bytes)
    try:
        preflight(resolved)
    except ConfigError as exc:
        raise ConfigError(server_paths.public_text(exc.message, settings.data_dir), field=exc.field) from None
    hp = spec.hyper_parameters
    samples = sum(f.samples or 0 for f in used if f.path in resolved.training_datasets)
    total_steps = hp.total_steps(samples)
    calibration = {"calibration_steps": steps_to_calibrate(total_steps), "total_steps": total_steps}
    job_id = new_id("opdjob")
    job = Job(
        id=job_id,
        tenant_id=tenant_id,
        job_name=spec.job_name,
        status="queued",
        spec=spec.model_dump(mode="json", exclude_none=True),  # every None is a default
        file_ids=sorted({f.id for f in used}),
        run_dir=str(settings.runs_dir / job_id),
        total_steps=calibration["calibration_steps"] if dry_run else total_steps,
        queued_at=time.time(),
        dry_run=calibration if dry_run else None,
    )
    session.add(job)
    session.flush()
    add_event(
        session, job_id, "status", "validating_files: pre-flight passed", {"status": "validating_files"}
    )
    if dry_run:
        message = (
            f"dry run: {calibration['calibration_steps']} calibration steps for an estimate of the whole job "
            f"({total_steps} steps); nothing it trains becomes a model"
        )
        add_event(session, job_id, "status", message, {"dry_run": calibration})
    add_event(session, job_id, "status", "queued", {"status": "queued"})
    session.commit()
    return public(job)


def resolve_for_driver(session: Session, job: Job) -> JobSpec:
    """The spec a driver runs: stored ids resolved to today's server paths (a dry run's calibration)."""
    with_models, _ = resolve_models(session, job.tenant_id, JobSpec.model_validate(job.spec))
    resolved, _ = resolve_files(session, job.tenant_id, with_models)
    if job.dry_run is not None:
        return calibration_spec(resolved, job.dry_run["calibration_steps"], ends_by_itself=True)
    return resolved


# -- reading ----------------------------------------------------------------------------------------


def list_jobs(session: Session, tenant_id: str, after: str | None, limit: int, status: str | None) -> JobList:
    """Newest first; `after` is the last id of the previous page."""
    query = select(Job).where(Job.tenant_id == tenant_id)
    if status is not None:
        query = query.where(Job.status == status)
    if after is not None:
        cursor = get_owned(session, tenant_id, after, "after")
        query = query.where(Job.pk < cursor.pk)
    rows = list(session.scalars(query.order_by(Job.pk.desc()).limit(limit + 1)))
    return JobList(data=[public(j) for j in rows[:limit]], has_more=len(rows) > limit)


def events_after(session: Session, job_id: str, after: int, limit: int) -> list[JobEvent]:
    query = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id > after)
    return list(session.scalars(query.order_by(JobEvent.id).limit(limit)))


def list_events(session: Session, tenant_id: str, job_id: str, after: int, limit: int) -> EventList:
    data_dir = server_paths.data_dir_of(get_owned(session, tenant_id, job_id))
    rows = events_after(session, job_id, after, limit + 1)
    return EventList(
        data=[server_paths.public_event(e, data_dir) for e in rows[:limit]], has_more=len(rows) > limit
    )


def stream_snapshot(session: Session, job_id: str, after: int) -> tuple[list[EventPublic], JobPublic | None]:
    """New events and the job's state for one turn of the SSE stream (the job may have been deleted,
    and its events with it)."""
    job = session.scalar(select(Job).where(Job.id == job_id))
    if job is None:
        return [], None
    data_dir = server_paths.data_dir_of(job)
    events = [server_paths.public_event(e, data_dir) for e in events_after(session, job_id, after, 500)]
    return events, public(job)


def format_log_line(event: JobEvent | EventPublic) -> str:
    """`TIME [type] message`, then an error's `data.detail` indented (`format_event_line`)."""
    return format_event_line(event.time, event.type, event.message, event.data)


def logs(session: Session, tenant_id: str, job_id: str, after: int, limit: int) -> str:
    data_dir = server_paths.data_dir_of(get_owned(session, tenant_id, job_id))
    events = (server_paths.public_event(e, data_dir) for e in events_after(session, job_id, after, limit))
    return "".join(format_log_line(e) + "\n" for e in events)


def checkpoints(session: Session, tenant_id: str, job_id: str) -> CheckpointList:
    job = get_owned(session, tenant_id, job_id)
    run_dir = RunDir(job.run_dir)
    records = finite(run_dir.records())
    by_step = {(r.get("kind"), r.get("step")): r for r in records}
    decision = run_dir.promoted()
    promoted = decision.checkpoint if decision is not None else None

    def values(record: dict[str, Any] | None) -> dict[str, Any] | None:
        if record is None:
            return None
        return {k: v for k, v in record.items() if k not in ("kind", "step") and not isinstance(v, str)}

    return CheckpointList(
        data=[
            CheckpointPublic(
                **{
                    **found,
                    "path": server_paths.run_name(job, found["path"]),
                    "student": server_paths.run_name(job, found["student"]),
                },
                metrics=values(by_step.get(("train", found["step"]))) or {},
                eval=values(by_step.get(("eval", found["step"]))),
                promoted=found["id"] == promoted,
            )
            for found in run_dir.checkpoints()
        ]
    )


def checkpoint_model(
    session: Session, tenant_id: str, job_id: str, checkpoint_id: str, merged: bool = False
) -> Path:
    """The student model folder of one of the tenant's checkpoints (404 for anything else): a LoRA
    job's adapter folder, or with `merged` its base model with the adapter merged in."""
    run_dir = RunDir(get_owned(session, tenant_id, job_id).run_dir)
    for found in run_dir.checkpoints():
        if found["id"] == checkpoint_id and Path(found["student"]).is_dir():
            student = Path(found["student"])
            return merged_folder(student) if merged and is_adapter_folder(student) else student
    raise not_found("checkpoint", checkpoint_id, "checkpoint_id")


def finite(value: Any) -> Any:
    """`value` with NaN/inf floats replaced by None: JSON responses and PostgreSQL reject them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def metrics(session: Session, tenant_id: str, job_id: str) -> MetricsPublic:
    run_dir = RunDir(get_owned(session, tenant_id, job_id).run_dir)
    return MetricsPublic(data=finite(run_dir.records()), summary=finite(run_dir.load_summary()))


# -- user actions -----------------------------------------------------------------------------------


def transition(session: Session, tenant_id: str, job_id: str, action: str) -> JobPublic:
    job = get_owned(session, tenant_id, job_id)
    current = job.status
    new = next_status(action, current)
    fields: dict[str, Any] = {"queued_at": time.time()} if new == "queued" else {}
    if not compare_and_set(session, job_id, current, new, **fields):
        session.rollback()
        session.refresh(job)
        raise APIError(409, "invalid_transition", f"job moved to {job.status} meanwhile; try again", "status")
    add_event(
        session,
        job_id,
        "status",
        f"{action} requested: {current} -> {new}",
        {"status": new, "action": action},
    )
    session.commit()
    session.refresh(job)
    return public(job)


def delete(session: Session, tenant_id: str, job_id: str) -> None:
    job = get_owned(session, tenant_id, job_id)
    if job.status not in TERMINAL:
        raise APIError(
            409,
            "invalid_transition",
            f"only finished jobs can be deleted; this one is {job.status}",
            "status",
        )
    session.query(JobEvent).filter(JobEvent.job_id == job_id).delete()
    keep_usage_of_deleted(session, job)
    session.delete(job)
    session.commit()
    shutil.rmtree(job.run_dir, ignore_errors=True)
