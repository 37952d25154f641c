"""A job's recorded trajectories, paged: the latest ones as written, or one step's (or all) sorted by
reward or by divergence (the mean sampler − teacher log-ratio over a trajectory's trained tokens).

A trajectory without the value sorted on (a failed rollout: no reward, no trained tokens; a record
from before tokens were recorded) comes after every one that has it, whatever the order.

The recorded validation rollouts (validation_trajectories.jsonl) are filtered by step, pass label, model
and sample id, and paged in the order written or sorted as above or by their evaluator's score
(`validation_trajectory_page`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from sqlalchemy.orm import Session

from api.services.jobs import finite, get_owned
from opd_trainer.storage.run_dir import RunDir, validation_passes_of
from opd_trainer.wire.schemas import (
    TrajectoryList,
    TrajectorySort,
    ValidationPass,
    ValidationTrajectoryList,
    ValidationTrajectorySort,
)

Order = Literal["desc", "asc"]


def sort_key(trajectory: dict[str, Any], sort: ValidationTrajectorySort) -> float | None:
    """The value `sort` orders by; None where the trajectory has none."""
    if sort == "reward":
        value = None if trajectory.get("failed") else trajectory.get("reward")
    elif sort == "score":
        value = trajectory.get("eval_score")
    else:
        value = trajectory.get("divergence")
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def sorted_trajectories(
    trajectories: list[dict[str, Any]], sort: ValidationTrajectorySort, order: Order
) -> list[dict[str, Any]]:
    """`trajectories` by `sort` (`recent`: as written), highest first for `desc`; those without the
    value last, in the order written (the sort is stable)."""
    if sort == "recent":
        return list(reversed(trajectories)) if order == "desc" else list(trajectories)
    keyed = [(sort_key(t, sort), t) for t in trajectories]
    valued = [(key, t) for key, t in keyed if key is not None]
    valued.sort(key=lambda pair: pair[0], reverse=order == "desc")
    return [t for _, t in valued] + [t for key, t in keyed if key is None]


def latest_page(run_dir: RunDir, limit: int, offset: int) -> tuple[list[dict[str, Any]], bool]:
    """The `limit` trajectories written before the `offset` latest ones, in the order written (the
    route's default: read from the file's end, whatever its size)."""
    found = run_dir.recent_trajectories(offset + limit + 1)
    end = max(0, len(found) - offset)
    return found[max(0, end - limit) : end], len(found) > offset + limit


def trajectory_page(
    session: Session,
    tenant_id: str,
    job_id: str,
    *,
    step: int | None,
    sort: TrajectorySort | None,
    order: Order,
    limit: int,
    offset: int,
) -> TrajectoryList:
    """A page of the job's trajectories. Without `step` and `sort`, the latest written (`latest_page`);
    else that step's (or every step's) ordered by `sort` (default `recent`) and `order`."""
    run_dir = RunDir(get_owned(session, tenant_id, job_id).run_dir)
    steps = run_dir.trajectory_steps()
    if step is None and sort is None:
        page, has_more = latest_page(run_dir, limit, offset)
    else:
        ordered = sorted_trajectories(run_dir.step_trajectories(step), sort or "recent", order)
        page, has_more = ordered[offset : offset + limit], len(ordered) > offset + limit
    return TrajectoryList(data=finite(page), has_more=has_more, steps=steps)


def validation_trajectory_page(
    session: Session,
    tenant_id: str,
    job_id: str,
    *,
    step: int | None,
    label: str | None,
    model: str | None,
    sample_id: str | None,
    sort: ValidationTrajectorySort = "recent",
    order: Order = "asc",
    limit: int,
    offset: int,
) -> ValidationTrajectoryList:
    """A page of the job's recorded validation rollouts matching every filter given, ordered by `sort`
    and `order` (default: as written); with every recorded pass (and its steps and labels) whatever
    the filters."""
    records = RunDir(get_owned(session, tenant_id, job_id).run_dir).validation_trajectories()
    passes = validation_passes_of(records)  # the file read once for both
    wanted = {"step": step, "label": label, "model": model, "sample_id": sample_id}
    given = {key: value for key, value in wanted.items() if value is not None}
    chosen = [r for r in records if all(r.get(key) == value for key, value in given.items())]
    chosen = sorted_trajectories(chosen, sort, order)
    return ValidationTrajectoryList(
        data=finite(chosen[offset : offset + limit]),
        has_more=len(chosen) > offset + limit,
        passes=[ValidationPass.model_validate(p) for p in passes],
        steps=sorted({p["step"] for p in passes}),
        labels=list(dict.fromkeys(p["label"] for p in passes)),
    )
