"""Job driver: one Ray actor per job, a thin shell over the job's phases.

`run()` reads the data, starts the job's parts (`components.start_components`: one frozen
`Components`), resumes from the latest checkpoint or runs the pre-flight drift probe and the first
validation (`validation`), then calls `step.train_step` (sample → score → reward → learn → publish) until
the last step, validating every `eval_steps` and checkpointing every `save_steps` and at the end. It
records each step (metrics.jsonl, trackers, events) and answers `progress()` and `events()` meanwhile.

Launch: through `opd train job.yaml` (local Ray) or the job server (`driver/launch.py`); never imports
user code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle

from opd_trainer.cluster.preemption import notices as preemption_notices
from opd_trainer.driver.components import Components, Started, start_components
from opd_trainer.driver.metering import Meter, budget_reached, usage_summary
from opd_trainer.driver.promotion import Promoter
from opd_trainer.driver.recovery import (
    DEFAULT_MAX_RECOVERIES,
    Lost,
    RecoveryLog,
    cause_of,
    death_error,
    probe,
)
from opd_trainer.driver.step import Sampler, StepClock, StepMark, train_step
from opd_trainer.driver.trackers import BackgroundTracker, open_trackers
from opd_trainer.driver.validation import Model, drift_probe_segments, evaluate, validation_records
from opd_trainer.engine.engine_sharing import EngineSharing
from opd_trainer.errors import ConfigError, OPDError
from opd_trainer.jobspec.dataset import EpochCursor, Sample, load_samples
from opd_trainer.jobspec.job_spec import JobSpec
from opd_trainer.jobspec.preflight import check_drift, check_references, check_task_records
from opd_trainer.records import LLMCall
from opd_trainer.rollout.runner import RolloutResult
from opd_trainer.storage.checkpoints import CheckpointStore
from opd_trainer.storage.run_dir import RunDir
from opd_trainer.storage.shared import check_probe
from opd_trainer.wire.checkpoint import CheckpointState, CursorState
from opd_trainer.wire.driver import (
    DriverEvent,
    DriverEventType,
    DriverProgress,
    DriverStatus,
    ValidationSummary,
)
from opd_trainer.workers.pool import pool_metrics

logger = logging.getLogger(__name__)

RESCUE_CHECKPOINT_S = 300.0  # the most a checkpoint before a restart may take; past it the restart goes on


def _node_of(_: object) -> str:
    """Run inside an actor (`__ray_call__`): the Ray node it is on."""
    return ray.get_runtime_context().get_node_id()


def error_event(exc: OPDError) -> tuple[str, dict[str, str | None]]:
    """An error as one line (`field: first line of the message`) plus its details in `data`.

    `exc.message` is the error's own text even when Ray re-raised it from an actor, whose `str()` would
    be Ray's remote traceback; what follows the first line (e.g. the user's traceback of a processor
    that failed to import) goes to `data.detail`.
    """
    headline, _, detail = exc.message.strip().partition("\n")
    data: dict[str, str | None] = {"field": exc.field}
    if detail.strip():
        data["detail"] = detail.strip()
    return (f"{exc.field}: {headline}" if exc.field else headline), data


class JobDriver:
    """Runs one job; `progress()` and `events()` may be called while `run()` is in flight."""

    def __init__(
        self,
        spec: JobSpec,
        run_dir: str,
        job_id: str = "local",
        storage_token: str | None = None,
        *,
        server: bool = False,
        teacher_sharing: EngineSharing | None = None,
        student_sharing: EngineSharing | None = None,
    ) -> None:
        """`storage_token`: what the caller wrote into the run dir (`storage.shared.write_probe`); the
        driver and every learner rank check they see it before anything else. `server`: started by
        the job server, whose tenants' code runs only sandboxed (`workers.sandbox.effective_mode`).
        `teacher_sharing`: score on teacher engines shared with other jobs (`engine/shared_engines.py`,
        the server's settings); None: the job starts its own. `student_sharing`: the same for a LoRA
        job's student engines (each job samples with its own adapter).
        Nothing here can fail: errors surface from `run()` as the job's error, where the server
        reports them."""
        self.spec = spec
        self.server = server
        self.teacher_sharing = teacher_sharing
        self.student_sharing = student_sharing
        self.job_id = job_id
        self.run_dir = Path(run_dir)
        self.storage_token = storage_token
        self._storage_error: OPDError | None = None
        if storage_token is not None:
            try:
                check_probe(self.run_dir, storage_token, "job driver")
            except ConfigError as exc:
                self._storage_error = exc
        if self._storage_error is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = RunDir(self.run_dir)
        self.train_samples: list[Sample] = []
        self.validation_samples: list[Sample] = []
        self.total_steps = 0
        self.step = 0
        self.status: DriverStatus = "created"
        self._stop_requested = False
        self._events: list[DriverEvent] = []
        self._latest: dict[str, float] = {}
        self._started_at = time.time()
        self._started = Started()  # what start-up started: stopped at the end, whatever happened
        self._sampler: Sampler | None = None  # exists once the components do
        self._components: Components | None = None  # the running parts (None while starting)
        self._mark = StepMark()  # how far the step under way got (`_checkpoint_before_restart`)
        self._recoveries = RecoveryLog(self.run_dir)
        self._notices_seen: set[tuple[str, object]] = set()  # preemption notices (node, time) acted on
        self._trackers: list[BackgroundTracker] = []  # report_to (opened in run())
        self._promoter = Promoter.for_job(spec)  # None: no validation data, the model is the last checkpoint
        # What earlier runs of this job used (a resume) is where this run's meter starts.
        self._meter = Meter(self.log.usage() if self._storage_error is None else None)
        self._usage: dict[str, float] = dict(self._meter.base)

    # -- observation ----------------------------------------------------------------------------

    @functools.cached_property
    def checkpoints(self) -> CheckpointStore:
        return self.log.checkpoint_store()

    def emit(self, kind: DriverEventType, message: str, **data: Any) -> None:
        """One job event: kept for `events()`, appended to events.jsonl and logged."""
        event = DriverEvent(seq=len(self._events), time=time.time(), type=kind, message=message, data=data)
        self._events.append(event)
        if self._storage_error is None:  # else the run dir here is not the one the server reads
            self.log.event(event)
        logger.info("[%s] %s: %s", self.job_id, kind, message)

    def events(self, after: int = -1) -> list[DriverEvent]:
        """This incarnation's events after `seq` `after`, in order."""
        return [e for e in self._events if e.seq > after]

    def progress(self) -> DriverProgress:
        elapsed = time.time() - self._started_at
        done = self.step
        eta = elapsed / done * (self.total_steps - done) if done and self.status == "running" else None
        return DriverProgress(
            status=self.status,
            step=self.step,
            total_steps=self.total_steps,
            # The latest step's metrics, with the pools' live numbers (the server exports them).
            metrics={**self._latest, **pool_metrics(self._started.pools)},
            eta_s=eta,
            usage=self._usage,  # as of the latest record (`driver/metering.py`)
        )

    def request_stop(self) -> None:
        """Stops after the current step, with a checkpoint (pause / cancel)."""
        self._stop_requested = True

    # -- the loop -------------------------------------------------------------------------------

    async def run(self, stop_after: int | None = None) -> ValidationSummary:
        """Trains to the end (or `stop_after` steps / a stop request) and returns the summary."""
        self.status = "running"
        self._started_at = time.time()
        try:
            self._load_data()
            self._report_ignored_fields()
            self._trackers = await asyncio.to_thread(open_trackers, self.spec, self.log, self.job_id)
            while True:
                try:
                    return await self._run_components(stop_after)
                except Exception as exc:
                    if not await self._recover(exc):
                        raise
        except OPDError as exc:
            self.status = "failed"
            message, data = error_event(exc)
            self.emit("error", message, **data)
            raise
        except Exception as exc:
            self.status = "failed"
            self.emit("error", f"{type(exc).__name__}: {exc}")
            raise
        finally:
            await self._close_trackers()
            await self.shutdown()

    async def _run_components(self, stop_after: int | None) -> ValidationSummary:
        """Starts the job's parts, resumes from the latest checkpoint (or runs the pre-flight of a fresh
        start) and trains; once per start, again after each recovery."""
        c = self._components = await start_components(
            self.spec,
            self.job_id,
            validates=bool(self.validation_samples),
            total_updates=self.total_steps * self._updates_per_step(),
            started=self._started,
            emit=self.emit,
            server=self.server,
            run_dir=self.run_dir,
            storage_token=self.storage_token,
            teacher_sharing=self.teacher_sharing,
            student_sharing=self.student_sharing,
        )
        cursor = EpochCursor(len(self.train_samples), self.spec.hyper_parameters.seed)
        sampler = self._sampler = Sampler(c, self.train_samples, cursor)
        if self.checkpoints.latest() is not None:
            summary = await self._resume(c, sampler)
            await self._validate_if_missed(c, sampler)
        else:
            if self._recoveries.entries():  # started again before any checkpoint: from the start
                self.log.truncate_after(-1)
                self.step = 0
                self._promoter = Promoter.for_job(self.spec)
            summary = await self._preflight(c)
        return await self._train(c, sampler, summary, stop_after)

    async def _recover(self, exc: Exception) -> bool:
        """After `exc` ended a run of the job's parts: False when it is not a lost component (the job
        fails with it). Else, within `resources.max_recoveries` and unless the same loss repeats at
        the same step (`OPDError`), checkpoints the step under way when the learner holds it intact,
        stops what is left and returns True: `run` starts the parts again and resumes."""
        if isinstance(exc, ConfigError) or self._stop_requested:
            # The job's own settings, or a cluster that cannot place its parts within
            # resources.placement_timeout_s (whose actors it killed): nothing a restart changes.
            return False
        death = death_error(exc)
        lost = await probe(self._held_actors())
        if death is None and not lost:
            return False
        cause = cause_of(lost, death)
        what = "; ".join(item.describe() for item in lost) or f"a component ({type(death).__name__})"
        budget = self.spec.resources.max_recoveries
        budget = DEFAULT_MAX_RECOVERIES if budget is None else budget
        refusal = self._recoveries.refusal(self.step, cause, budget)
        if refusal is not None:
            message = f"lost {what} at step {self.step + 1}; {refusal}"
            raise OPDError(message, field="resources.max_recoveries")
        await self._checkpoint_before_restart(lost)
        resumes_from = self.checkpoints.latest_step()
        count = self._recoveries.add(self.step, cause, what, resumes_from)
        start = "the start" if resumes_from is None else f"the checkpoint of step {resumes_from}"
        when = f"during step {self.step + 1}" if self._mark.cursor is not None else f"after step {self.step}"
        self.emit(
            "recovery",
            f"lost {what} {when}; restarting the job's parts and resuming from {start} "
            f"(recovery {count} of at most {budget})",
            lost=[dataclasses.asdict(item) for item in lost],
            error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
            step=self.step,
            resumes_from=resumes_from,
            recovery=count,
            max_recoveries=budget,
        )
        await self.shutdown()
        self._started, self._sampler, self._components = Started(), None, None
        self._meter = self._meter.carried_over(self._usage)
        return True

    def _held_actors(self) -> dict[str, ActorHandle]:
        """Every actor the job's parts run in, by what it is for the job (probed after a failure)."""
        c, started = self._components, self._started
        held: dict[str, ActorHandle] = {}
        if c is not None:
            several = c.teachers.several
            teachers = {f"teacher {n}" if several else "teacher": g for n, g in c.teachers.groups.items()}
            groups = {"student": c.student, **teachers}
            for role, group in groups.items():
                for index, actor in enumerate(group.actors):
                    held[f"{role} engine replica {index}"] = actor
        else:  # start-up failed half-way: what it had started
            for number, group in enumerate(started.engines):
                for index, actor in enumerate(group.actors):
                    held[f"engine group {number} replica {index}"] = actor
        learner = c.learner if c is not None else started.learner
        for rank, actor in enumerate(learner.actors if learner is not None else []):
            held[f"learner rank {rank}"] = actor
        for index, actor in enumerate(started.gateways):
            held[f"gateway host {index}"] = actor
        # One name per actor (a LoRA job's teacher may be its student's engines): the first given.
        unique: dict[object, tuple[str, ActorHandle]] = {}
        for name, actor in held.items():
            unique.setdefault(actor._actor_id, (name, actor))
        return dict(unique.values())

    async def _preemption_noticed(self) -> bool:
        """Whether a node holding one of the job's parts has posted a preemption notice since the last
        look (`cluster/preemption.py`); each such notice becomes a `preemption` event."""
        found = await asyncio.to_thread(preemption_notices)
        new = {node: n for node, n in found.items() if (node, n.get("time")) not in self._notices_seen}
        if not new:
            return False
        nodes = await self._held_nodes()
        hit = False
        for node, notice in new.items():
            self._notices_seen.add((node, notice.get("time")))
            parts = nodes.get(node)
            if not parts:
                continue
            hit = True
            message = (
                f"node {node[:12]} goes away within {float(notice.get('grace_s', 0)):g}s "
                f"({notice.get('reason', 'preempted')}); it holds {', '.join(parts)}: checkpointing step "
                f"{self.step} now"
            )
            self.emit("preemption", message, node_id=node, parts=parts, step=self.step, notice=notice)
        return hit

    async def _held_nodes(self) -> dict[str, list[str]]:
        """The Ray node of each of the job's parts: node id -> the parts there."""
        held = self._held_actors()
        found = await asyncio.gather(
            *(actor.__ray_call__.remote(_node_of) for actor in held.values()), return_exceptions=True
        )
        nodes: dict[str, list[str]] = {}
        for name, node in zip(held, found, strict=True):
            if isinstance(node, str):
                nodes.setdefault(node, []).append(name)
        return nodes

    async def _checkpoint_before_restart(self, lost: list[Lost]) -> None:
        """A checkpoint of the step the job is at, when it is newer than the latest and the learner
        holds exactly it (every rank alive, and a failed step had not reached its update): the restart
        then loses at most the step under way. Skipped (an event says why) when it fails."""
        c, sampler, mark = self._components, self._sampler, self._mark
        if c is None or sampler is None or any(item.name.startswith("learner") for item in lost):
            return
        if self.step == 0:  # the start's pre-flight and baseline validation run again instead
            return
        if mark.learner_started or self.checkpoints.latest_step() == self.step:
            return
        try:
            await asyncio.wait_for(self.save_checkpoint(c, sampler, cursor=mark.cursor), RESCUE_CHECKPOINT_S)
        except Exception as exc:  # the restart resumes from the previous checkpoint instead
            why = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
            self.emit("warning", f"no checkpoint of step {self.step} before the restart ({why})")

    async def _train(
        self, c: Components, sampler: Sampler, summary: ValidationSummary, stop_after: int | None
    ) -> ValidationSummary:
        hp = self.spec.hyper_parameters
        self.emit("status", f"training {self.total_steps} steps", total_steps=self.total_steps)
        clock = StepClock()
        while self.step < self.total_steps:
            last = self.step if self._stop_requested else self.total_steps - 1
            self._mark = StepMark()
            metrics = await train_step(
                c,
                sampler,
                self.step,
                sample_ahead_to=min(self.step + hp.max_staleness, last),
                clock=clock,
                log=self.log,
                mark=self._mark,
            )
            self._mark = StepMark()  # between steps: the learner holds the step the job is at
            self._meter.add_step(metrics)
            recorded = await self._with_usage(c, metrics)
            # From here to the record no await: whoever sees the new step (`progress()`) finds its
            # record in metrics.jsonl (the server sums trained tokens from it).
            self.step += 1
            self._latest = metrics
            self._record("train", self.step, recorded)
            self.emit(
                "step",
                f"step {self.step}/{self.total_steps} reverse_kl={metrics['reverse_kl']:.4f} "
                f"tokens/s={metrics['tokens_per_s']:.0f}",
                step=self.step,
                total_steps=self.total_steps,
                **{k: metrics[k] for k in ("reverse_kl", "loss", "tokens_per_s")},
            )
            reached = budget_reached(self.spec.budget, self._usage)
            if reached is not None:
                message = f"{reached}; stopping after step {self.step} ({usage_summary(self._usage)})"
                self.emit("budget", message, step=self.step, usage=self._usage)
                await sampler.drop_ahead()
                break
            stopping = self._stop_requested or (stop_after is not None and self.step >= stop_after)
            with clock.excluded():
                noticed = await self._preemption_noticed()
                await self._between_steps(c, sampler, stopping, checkpoint=noticed)
            if stopping:
                self.status = "stopped"
                self.emit("status", f"stopped after step {self.step}", step=self.step)
                return summary
        return await self._finish(c, sampler, summary)

    async def _between_steps(
        self, c: Components, sampler: Sampler, stopping: bool, *, checkpoint: bool = False
    ) -> None:
        """Validation every `eval_steps` (a new best is promoted and checkpointed at once), and a
        checkpoint every `save_steps`, before a stop, or when `checkpoint` (a preemption notice)."""
        hp = self.spec.hyper_parameters
        promoted = await self._validate_step(c) if self._validates_now() else False
        if self.step % hp.save_steps == 0 or stopping or promoted or checkpoint:
            await self.save_checkpoint(c, sampler)
        if promoted:
            self._promote(final=False)

    def _validates_now(self) -> bool:
        """Whether the step the job is at is one that validates (every `eval_steps`, not the last)."""
        eval_steps = self.spec.hyper_parameters.eval_steps
        return bool(self.validation_samples) and self.step % eval_steps == 0 and self.step < self.total_steps

    async def _validate_step(self, c: Components) -> bool:
        """The validation of the step the job is at, recorded; whether it is a new best to promote."""
        metrics = await self._evaluate(c, f"step {self.step}")
        self._record("eval", self.step, await self._with_usage(c, metrics))
        return self._promoter is not None and self._promoter.consider(self.step, metrics)

    async def _validate_if_missed(self, c: Components, sampler: Sampler) -> None:
        """After a resume: the validation of the resumed step when it has none (a part lost during
        it, checkpointed before the restart), so no curve point or promotion candidate goes missing."""
        if not self._validates_now():
            return
        if any(r["kind"] == "eval" and r["step"] == self.step for r in self.log.records()):
            return
        if await self._validate_step(c):
            await self.save_checkpoint(c, sampler)
            self._promote(final=False)

    async def _finish(self, c: Components, sampler: Sampler, summary: ValidationSummary) -> ValidationSummary:
        """The last validation, the final checkpoint and the promotion decision."""
        if self.validation_samples:
            summary["student_after"] = await self._evaluate(c, "student after")
            self._record("eval", self.step, await self._with_usage(c, summary["student_after"]))
            if self._promoter is not None:
                self._promoter.consider(self.step, summary["student_after"])
        if self.checkpoints.latest_step() != self.step:
            await self.save_checkpoint(c, sampler)
        if self._promoter is not None:
            self._promote(final=True)
        self.log.save_summary(summary)
        self.emit("usage", usage_summary(self._usage), **self._usage)
        self.status = "succeeded"
        self.emit("status", "succeeded", step=self.step)
        return summary

    def _promote(self, *, final: bool) -> None:
        """Writes the promotion decision so far (`final`: the job's) and says it in an event."""
        if self._promoter is None:
            return
        best = self._promoter.best_step
        decision = self._promoter.decision(None if best is None else self.checkpoints.name(best), final=final)
        self.checkpoints.promote(decision)
        if decision.checkpoint is not None:
            message = f"promoted {decision.checkpoint}: {decision.reason}"
            self.emit("promotion", message, **decision.model_dump())
        elif final:
            self.emit("warning", f"no fine_tuned_model: {decision.reason}", promotion=decision.model_dump())

    async def shutdown(self) -> None:
        """Stops everything this job started (also after a start-up that failed half-way)."""
        if self._sampler is not None:
            await self._sampler.drop_ahead()
        await self._started.stop()

    # -- set-up ---------------------------------------------------------------------------------

    def _load_data(self) -> None:
        """Reads the datasets (after the storage check: a path the driver cannot see fails there)."""
        if self._storage_error is not None:
            raise self._storage_error
        spec, hp = self.spec, self.spec.hyper_parameters
        self.train_samples = load_samples(spec.training_datasets, "training_datasets")
        check_references(self.train_samples, hp.teacher_hindsight)
        check_task_records(self.train_samples, "training_datasets", spec.is_agentic)
        if spec.validation_datasets:
            self.validation_samples = load_samples(spec.validation_datasets, "validation_datasets")
            check_task_records(self.validation_samples, "validation_datasets", spec.is_agentic)
        self.total_steps = hp.total_steps(len(self.train_samples))

    def _updates_per_step(self) -> int:
        hp = self.spec.hyper_parameters
        return math.ceil(hp.batch_size * hp.n_rollouts / hp.ppo_mini_batch_size)

    async def _preflight(self, c: Components) -> ValidationSummary:
        """A fresh run: the drift probe, then the teacher's and the starting student's validation."""
        probe = await drift_probe_segments(c, self.train_samples)
        drift = await check_drift(c.learner, probe, self.spec.hyper_parameters.max_drift)
        message = f"learner/sampler drift mean {drift['mean']:.2e} max {drift['max']:.2e}"
        self.emit("preflight", message, **drift)
        summary: ValidationSummary = {}
        if self.validation_samples:
            summary["teacher"] = await self._evaluate(c, "teacher", teacher=True)
            summary["student_before"] = await self._evaluate(c, "student before")
            self._record("eval", 0, await self._with_usage(c, summary["student_before"]))
            if self._promoter is not None:
                self._promoter.observe_start(summary["student_before"])
        self.log.save_summary(summary)
        return summary

    async def _evaluate(self, c: Components, label: str, *, teacher: bool = False) -> dict[str, float]:
        """A validation pass at this step; its first rollouts go to validation_trajectories.jsonl."""
        step = self.step
        model: Model = "teacher" if teacher else "student"

        def record(results: list[RolloutResult], scored: list[LLMCall]) -> None:
            records = validation_records(results, step, label, model, scored, c.tokenizer)
            self.log.add_validation_trajectories(records)

        return await evaluate(c, self.validation_samples, label, self.emit, teacher=teacher, record=record)

    # -- checkpoints ----------------------------------------------------------------------------

    async def save_checkpoint(
        self, c: Components, sampler: Sampler, cursor: dict[str, int] | None = None
    ) -> Path:
        """A checkpoint of the step the job is at. `cursor`: the data cursor to keep when it is not the
        sampler's (a step that failed: the state before its batch)."""
        # A save that fails leaves nothing behind; a full disk is an error naming where and how much
        # (`CheckpointStore.saving`), the previous checkpoint intact.
        with self.checkpoints.saving(self.step) as staging:
            await c.learner.save_checkpoint(str(staging))
            # With batches under way for the next steps the cursor is ahead of them: the checkpoint
            # keeps the state before the first, and a resume samples them again.
            state = CheckpointState(
                step=self.step,
                cursor=CursorState.model_validate(cursor if cursor is not None else sampler.cursor_state()),
                total_steps=self.total_steps,
                promotion=None if self._promoter is None else self._promoter.state(),
            )
            path = self.checkpoints.commit(staging, state)
        self.emit("checkpoint", f"saved step {self.step}", step=self.step, path=str(path))
        keep_last_n = self.spec.hyper_parameters.keep_last_n
        if keep_last_n is not None:
            removed = self.checkpoints.prune(keep_last_n)
            if removed:
                message = f"removed {', '.join(removed)} (keep_last_n={keep_last_n}; the best is kept)"
                self.emit("checkpoint", message, removed=removed)
        return path

    async def _resume(self, c: Components, sampler: Sampler) -> ValidationSummary:
        """Continues from the latest checkpoint: learner state, data cursor, step, student weights."""
        latest = self.checkpoints.latest()
        if latest is None:
            raise OPDError("no checkpoint to resume from")
        path, state = latest
        await c.learner.load_checkpoint(str(path))
        self.step = state.step
        sampler.cursor.restore(state.cursor.model_dump())
        if self._promoter is not None:
            self._promoter.restore(state.promotion)
        discarded = self.log.truncate_after(self.step)
        await c.publish_weights(self.step)
        # Step events of discarded steps stay in the event log (ids are never reused); this event names
        # them. Metrics, curves and trajectories keep only the checkpointed steps.
        message = f"resumed from checkpoint at step {self.step}"
        if discarded:
            message += f"; steps {discarded[0]}-{discarded[-1]} after it are discarded and redone"
        self.emit("status", message, step=self.step, discarded_steps=discarded)
        return self.log.load_summary()

    # -- records --------------------------------------------------------------------------------

    async def _with_usage(self, c: Components, metrics: dict[str, float]) -> dict[str, float]:
        """`metrics` and what the job used since the previous record (`usage/...`,
        `driver/metering.py`); the job's usage is read now and usage.json rewritten."""
        self._usage = await self._meter.read(c)
        self.log.save_usage(self._usage)
        return {**metrics, **self._meter.deltas(self._usage)}

    def _record(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        """A training (`train`) or validation (`eval`) record: metrics.jsonl, then queued for each
        tracker of `report_to` (written on its own thread: never waited for here); what the trackers
        reported since (slow, failed and dropped) becomes `warning` events."""
        (self.log.step if kind == "train" else self.log.eval)(step, metrics)
        for tracker in self._trackers:
            tracker.log(kind, step, metrics)
        self._tracker_notices()

    def _tracker_notices(self) -> None:
        for tracker in self._trackers:
            for notice in tracker.notices():
                self.emit("warning", notice)
        self._trackers = [tracker for tracker in self._trackers if not tracker.failed]

    async def _close_trackers(self) -> None:
        """Each tracker writes what is queued and closes (off the loop, each within its time bound)."""
        await asyncio.gather(*(asyncio.to_thread(t.close, self.status) for t in self._trackers))
        self._tracker_notices()
        self._trackers = []

    def _report_ignored_fields(self) -> None:
        """One `warning` event per job for the Bailian-only settings it gave (a resumed run finds it)."""
        ignored = self.spec.ignored_fields
        if not ignored:
            return
        if any("ignored_fields" in event.data for event in self.log.events()):
            return
        self.emit(
            "warning",
            "ignored Bailian-only fields, they have no meaning here: " + ", ".join(sorted(ignored)),
            ignored_fields=ignored,
        )


JobDriverActor = ray.remote(JobDriver)
"""`JobDriver` as a Ray actor: one per job."""
