"""Job driver: one Ray actor per job that runs the OPD loop end to end.

Per step: a batch of prompts → `n_rollouts` student samples each → the teacher scores exactly those
tokens → the learner takes a reverse-KL (+ reward) step → new weights are synced into the student
engines. It validates every `eval_steps`, checkpoints every `save_steps` and at the end, and resumes
from the latest checkpoint in its run directory.

Validation measures what every job has, never a particular task: the reverse KL to the teacher on
validation prompts (seeded student samples, scored by the teacher), and the job's own rollout, reward
and evaluator components run on one greedy rollout per validation sample, for the student and, as the
baseline, for the teacher (through a gateway of its own). A sample that cannot be scored is counted and
named in the events; the job goes on.

Launch: through `opd train job.yaml` (local Ray) or the job server; never imports user code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import math
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from opd_trainer.driver.teacher_hindsight import hindsight_notes, teacher_inputs
from opd_trainer.driver.trackers import BackgroundTracker, open_trackers
from opd_trainer.engine.vllm_engine import EngineConfig, EngineGroup
from opd_trainer.errors import ConfigError, OPDError, ProcessorLoadError
from opd_trainer.jobspec.dataset import EpochCursor, Sample, load_samples
from opd_trainer.jobspec.job_spec import EngineResources, FunctionComponent, JobSpec
from opd_trainer.jobspec.preflight import (
    check_drift,
    check_references,
    check_same_tokenizer,
    check_task_records,
    resolve_max_length,
)
from opd_trainer.learner.deepspeed_learner import LearnerGroup
from opd_trainer.learner.hindsight import hindsight_advantages
from opd_trainer.learner.settings import LearnerSettings
from opd_trainer.records import LLMCall
from opd_trainer.rollout.agent_eval import agent_metrics, pass_at_k, success_by_threshold
from opd_trainer.rollout.chat import prompt_token_ids
from opd_trainer.rollout.gateway import GatewayActor
from opd_trainer.rollout.runner import (
    STUDENT_MODEL_NAME,
    TEACHER_MODEL_NAME,
    AuxiliaryModel,
    RolloutResult,
    RolloutRunner,
    failure_message,
    rollout_step_metrics,
    scoring_failures,
    validation_metrics,
)
from opd_trainer.stats import mean
from opd_trainer.storage.checkpoints import CheckpointStore
from opd_trainer.storage.run_dir import RunDir
from opd_trainer.storage.shared import check_probe
from opd_trainer.workers.pool import pool_metrics, user_code_resources
from opd_trainer.workers.sandbox import (
    SandboxUnavailable,
    configured_mode,
    configured_network,
    effective_mode,
    unconfined_reason,
)


@dataclasses.dataclass
class NextStep:
    """A step's rollouts under way (early with `max_staleness >= 1`) and the teacher's scores of them."""

    cursor: dict[str, Any]  # the data cursor before this step's batch was taken
    rollouts: asyncio.Task[list[RolloutResult]]
    scored: asyncio.Task[list[LLMCall]]


logger = logging.getLogger(__name__)


TRAJECTORIES_PER_STEP = 16
# Samples named in one validation's failure event (the count is always complete).
REPORTED_FAILURES = 20


def error_event(exc: OPDError) -> tuple[str, dict[str, Any]]:
    """An error as one line (`field: first line of the message`) plus its details in `data`.

    `exc.message` is the error's own text even when Ray re-raised it from an actor, whose `str()` would
    be Ray's remote traceback; what follows the first line (e.g. the user's traceback of a processor
    that failed to import) goes to `data.detail`.
    """
    headline, _, detail = exc.message.strip().partition("\n")
    data: dict[str, Any] = {"field": exc.field}
    if detail.strip():
        data["detail"] = detail.strip()
    return (f"{exc.field}: {headline}" if exc.field else headline), data


def request_seed(job_seed: int, step: int, index: int) -> int:
    """A distinct, reproducible sampler seed per (step, request): resumed runs resample identically."""
    return (job_seed * 1_000_003 + step * 10_007 + index) % (2**31 - 1)


def reverse_kl_metrics(
    sampler_logprobs: list[list[float]], teacher_logprobs: list[list[float]]
) -> dict[str, float]:
    """Reverse KL, teacher/student logprob and entropy estimate over every token of the given calls
    (`learner.loss.distillation_metrics`; the one place the driver measures reverse KL)."""
    import torch

    from opd_trainer.learner.loss import distillation_metrics

    sampler_1_T = torch.tensor([[lp for row in sampler_logprobs for lp in row]])
    teacher_1_T = torch.tensor([[lp for row in teacher_logprobs for lp in row]])
    return distillation_metrics(sampler_1_T, teacher_1_T, torch.ones_like(sampler_1_T))


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
    ) -> None:
        """`storage_token`: what the caller wrote into the run dir (`shared_storage.write_probe`); the
        driver and every learner rank check they see it before anything else. `server`: started by
        the job server, whose tenants' code runs only sandboxed (`workers.sandbox.effective_mode`).
        Nothing here can fail: errors surface from `run()` as the job's error, where the server
        reports them."""
        self.spec = spec
        self.server = server
        self._sandbox: dict[str, Any] = {}  # the pools' sandbox options, read at start-up
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
        self.cursor = EpochCursor(1, spec.hyper_parameters.seed)
        self.step = 0
        self.status = "created"
        self._stop_requested = False
        self._events: list[dict[str, Any]] = []
        self._latest: dict[str, float] = {}
        self._started_at = time.time()
        self._student: EngineGroup | None = None
        self._weight_transfers: list[str] = []  # handoff kind per student replica
        self._teacher: EngineGroup | None = None
        self._learner: LearnerGroup | None = None
        self._gateway: Any = None
        self._runner: RolloutRunner | None = None
        self._teacher_gateway: Any = None
        self._gateways_ready: list[Any] = []  # the gateways' ready() calls, started with the engines
        self._teacher_runner: RolloutRunner | None = None
        self._pools: list[Any] = []
        self._max_length = 0
        self._tokenizer: Any = None
        # max_staleness > 0: the next step's rollouts, sampled while this step trains (see train_one_step).
        self._next: NextStep | None = None
        self._trackers: list[BackgroundTracker] = []  # report_to (opened in run())

    # -- observation ----------------------------------------------------------------------------

    @functools.cached_property
    def checkpoints(self) -> CheckpointStore:
        return self.log.checkpoint_store()

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
        self.cursor = EpochCursor(len(self.train_samples), hp.seed)

    def emit(self, kind: str, message: str, **data: Any) -> None:
        event = {
            "seq": len(self._events),
            "time": time.time(),
            "type": kind,
            "message": message,
            "data": data,
        }
        self._events.append(event)
        if self._storage_error is None:  # else the run dir here is not the one the server reads
            self.log.event(event)
        logger.info("[%s] %s: %s", self.job_id, kind, message)

    def events(self, after: int = -1) -> list[dict[str, Any]]:
        return [e for e in self._events if e["seq"] > after]

    def progress(self) -> dict[str, Any]:
        elapsed = time.time() - self._started_at
        done = self.step
        eta = elapsed / done * (self.total_steps - done) if done and self.status == "running" else None
        return {
            "status": self.status,
            "step": self.step,
            "total_steps": self.total_steps,
            # The latest step's metrics, with the pools' live numbers (the server exports them).
            "metrics": {**self._latest, **pool_metrics(self._pools)},
            "eta_s": eta,
        }

    def request_stop(self) -> None:
        """Stops after the current step, with a checkpoint (pause / cancel)."""
        self._stop_requested = True

    # -- set-up ---------------------------------------------------------------------------------

    def _updates_per_step(self) -> int:
        hp = self.spec.hyper_parameters
        return math.ceil(hp.batch_size * hp.n_rollouts / hp.ppo_mini_batch_size)

    async def _start_components(self) -> None:
        import torch
        from transformers import AutoTokenizer

        spec, hp = self.spec, self.spec.hyper_parameters
        if spec.functions:
            mode = configured_mode()
            self._sandbox = {
                "sandbox_mode": mode,
                "sandbox_network": configured_network(),
                "server": self.server,
            }
            # Where user code runs on this node too (no user-code group), a job whose code cannot run
            # confined stops here, before any engine starts; every worker checks again on its node.
            if not user_code_resources():
                try:
                    effective_mode(mode, server=self.server)
                except SandboxUnavailable as exc:
                    raise ProcessorLoadError(str(exc), field="functions") from None
        check_same_tokenizer(spec.model, spec.teacher_model)
        self._max_length = resolve_max_length(hp.max_length, spec.model, spec.teacher_model)
        self._tokenizer = AutoTokenizer.from_pretrained(spec.model, trust_remote_code=False)
        on_gpu = torch.cuda.is_available()
        world_size = max(1, spec.resources.learner_gpus)
        # Mini-batches are split across ranks by prompt group: each needs a group per rank.
        rollouts = hp.batch_size * hp.n_rollouts
        smallest = min(hp.ppo_mini_batch_size, rollouts % hp.ppo_mini_batch_size or hp.ppo_mini_batch_size)
        if smallest < world_size * hp.n_rollouts:
            raise ConfigError(
                f"with {world_size} learner ranks every mini-batch needs {world_size} prompt groups "
                f"({world_size * hp.n_rollouts} rollouts); the smallest of this job's has {smallest}",
                field="hyper_parameters.ppo_mini_batch_size",
            )
        settings = LearnerSettings.from_spec(spec, self.total_steps * self._updates_per_step())
        self.emit("status", "starting engines and learner")
        # The gateways (vLLM's request validation and tool-call parser: a vLLM import of their own)
        # start beside the engines and learner; they get their engines once those are up.
        self._gateway = self._new_gateway(spec.model, STUDENT_MODEL_NAME)
        self._gateways_ready = [self._gateway.ready.remote()]
        if self.validation_samples or spec.auxiliary_models:
            self._teacher_gateway = self._new_gateway(spec.teacher_model, TEACHER_MODEL_NAME)
            self._gateways_ready.append(self._teacher_gateway.ready.remote())
        learner_gpus = spec.resources.learner_gpu_fraction if on_gpu else 0.0
        self._learner = LearnerGroup(
            settings,
            world_size,
            learner_gpus,
            placement_timeout_s=spec.resources.placement_timeout_s,
            ray_resources=spec.resources.learner_ray_resources,
        )

        def engines(model: str, resources: EngineResources, role: str) -> Awaitable[EngineGroup]:
            config = EngineConfig(
                model=model,
                max_model_len=self._max_length,
                resources=resources,
                seed=hp.seed,
                concurrent_sequences=hp.batch_size * hp.n_rollouts,
                role=role,
                # vLLM refuses a request for more top-k logprobs than this; 20 is its own default.
                max_logprobs=max(20, hp.teacher_top_k) if role == "teacher" else 20,
                placement_timeout_s=spec.resources.placement_timeout_s,
            )
            return EngineGroup.start(config, f"{self.job_id}-{role}")

        self._student, self._teacher, _ = await asyncio.gather(
            engines(spec.model, spec.resources.student, "student"),
            engines(spec.teacher_model, spec.resources.teacher, "teacher"),
            self._learner.initialize(),
        )
        if self.storage_token is not None:
            await self._learner.check_storage(str(self.run_dir), self.storage_token)
        try:
            self._weight_transfers = await self._student.transfers(
                spec.resources.weight_transfer, await self._learner.node_id()
            )
        except ValueError as exc:
            raise ConfigError(str(exc), field="resources.weight_transfer") from None
        self.emit(
            "status",
            f"student weights reach the engines by {', '.join(sorted(set(self._weight_transfers)))}",
            weight_transfers=self._weight_transfers,
        )
        await self._start_rollout_path()

    async def _publish_weights(self, version: int) -> None:
        """The learner's weights to every student replica, each by its handoff kind."""
        assert self._learner is not None and self._student is not None
        handoffs = await self._learner.export_weights(self._weight_transfers)
        try:
            await self._student.update_weights([handoffs[kind] for kind in self._weight_transfers], version)
        finally:
            await self._learner.release_weights(list(handoffs.values()))

    def _workspace(self, component: FunctionComponent) -> Path:
        fcmodel = component.fcmodel
        if fcmodel.zipdir is None:
            raise ConfigError(
                "workspace file ids are resolved by the job server; give zipdir for a local run",
                field=f"functions.{component.name}.fcmodel.workspace",
            )
        path = Path(fcmodel.zipdir)
        if not path.exists():
            raise ConfigError(f"{path} does not exist", field=f"functions.{component.name}.fcmodel.zipdir")
        return path

    def _new_gateway(self, model: str, served_name: str) -> Any:
        """A recording gateway for `model`'s engines (given later, `_serve_gateway`), on this driver's
        node: a zero-CPU actor fits anywhere, and one Ray put on a worker node would take the job
        down with that node (seen in CI: the gateway landed on the processor pools' node, killed)."""
        hp = self.spec.hyper_parameters
        this_node = ray.get_runtime_context().get_node_id()
        beside_the_driver = NodeAffinitySchedulingStrategy(this_node, soft=False)
        return GatewayActor.options(  # type: ignore[attr-defined]
            num_cpus=0, scheduling_strategy=beside_the_driver
        ).remote(
            served_name,
            model,
            [],
            max_tokens=hp.max_tokens,
            temperature=hp.temperature,
            max_length=self._max_length,
            tool_call_parser=self.spec.tool_call_parser,
            chat_template_kwargs=self.spec.chat_template_kwargs,
        )

    async def _serve_gateway(self, gateway: Any, engines: EngineGroup) -> str:
        """Hands `gateway` its engines and starts its HTTP server; returns the base URL."""
        await gateway.set_engines.remote(engines.actors)
        # On a cluster the rollout workers may sit on other nodes: listen on every interface there.
        host = "127.0.0.1" if self._single_node() else "0.0.0.0"
        return await gateway.serve.remote(host)  # type: ignore[no-any-return]

    async def _start_rollout_path(self) -> None:
        """The recording gateway in front of the student, and the user's worker pools if any.

        With validation data, a second gateway fronts the teacher, so the teacher's baseline runs through
        the same rollout, reward and evaluator code as the student's validation; the same gateway serves
        the teacher to the processors under the names in `auxiliary_models`.
        """
        from reward_workers.pool import RewardPool
        from rollout_workers.pool import RolloutPool

        assert self._student is not None and self._teacher is not None and self._gateway is not None
        spec, hp = self.spec, self.spec.hyper_parameters
        base_url = await self._serve_gateway(self._gateway, self._student)

        def on_event(event: dict[str, Any]) -> None:
            message = f"{event['pool']}: {event['from']} -> {event['to']} workers ({event['reason']})"
            self.emit("autoscale", message, **{k: v for k, v in event.items() if k != "type"})

        options: dict[str, Any] = {"on_event": on_event, **self._sandbox}
        rollout_pool = None
        for component in spec.rollout_components:
            rollout_pool = RolloutPool(self.job_id, component, self._workspace(component), **options)
        reward_pools = [
            RewardPool(self.job_id, c, self._workspace(c), **options) for c in spec.reward_components
        ]
        evaluator_pool = None
        if self.validation_samples:
            for component in spec.evaluator_components:
                evaluator_pool = RewardPool(self.job_id, component, self._workspace(component), **options)
        self._pools = [p for p in (rollout_pool, *reward_pools, evaluator_pool) if p is not None]
        if self._pools:
            self.emit(
                "status", "loading user processors: " + ", ".join(p.component.name for p in self._pools)
            )
        await asyncio.gather(*(pool.start() for pool in self._pools))
        for pool in self._pools:
            self.emit("status", f"{pool.component.name} runs in {pool.confinement}", sandbox=pool.confinement)
            if (pool.confinement or "").startswith("no sandbox"):
                why = unconfined_reason()
                message = f"{pool.component.name}: user processors run without a sandbox: {why}"
                self.emit("warning", message, sandbox="none")
        teacher_url = None
        if self._teacher_gateway is not None:
            teacher_url = await self._serve_gateway(self._teacher_gateway, self._teacher)
        auxiliary = {
            name: AuxiliaryModel(self._teacher_gateway, teacher_url, TEACHER_MODEL_NAME)
            for name in spec.auxiliary_models  # every value is "teacher", the only model served
        }
        options: dict[str, Any] = {
            "max_tokens": hp.max_tokens,
            "temperature": hp.temperature,
            "rollout_pool": rollout_pool,
            "reward_pools": reward_pools,
            "evaluator_pool": evaluator_pool,
            "auxiliary_models": auxiliary,
        }
        self._runner = RolloutRunner(self.job_id, self._gateway, base_url, **options)
        if teacher_url is not None and self.validation_samples:
            self._teacher_runner = RolloutRunner(self.job_id, self._teacher_gateway, teacher_url, **options)
        # vLLM's tool-call parsers loaded in the gateways meanwhile; a bad parser name fails here.
        await asyncio.gather(*self._gateways_ready)

    @staticmethod
    def _single_node() -> bool:
        return sum(1 for node in ray.nodes() if node.get("Alive")) <= 1

    async def shutdown(self) -> None:
        """Stops everything this job started; vLLM engines take seconds each, so in parallel."""
        await self._drop_next_step()
        for runner in (self._runner, self._teacher_runner):
            if runner is not None:
                await runner.close()
        gateways = [g for g in (self._gateway, self._teacher_gateway) if g is not None]
        stops = [pool.shutdown() for pool in self._pools]
        stops += [group.shutdown() for group in (self._student, self._teacher) if group is not None]
        stops += [gateway.shutdown.remote() for gateway in gateways]
        await asyncio.gather(*stops, return_exceptions=True)
        for gateway in gateways:
            ray.kill(gateway)
        if self._learner is not None:
            self._learner.shutdown()
        self._runner, self._teacher_runner, self._pools = None, None, []
        self._gateway = self._teacher_gateway = None
        self._student = self._teacher = self._learner = None

    # -- one step -------------------------------------------------------------------------------

    def _prompt(self, sample: Sample) -> list[int]:
        return prompt_token_ids(
            self._tokenizer, sample.messages, sample.tools, self.spec.chat_template_kwargs
        )

    async def _segments(self, results: list[RolloutResult]) -> list[LLMCall]:
        """One segment per recorded LLM call of every successful rollout, scored by the teacher."""
        assert self._teacher is not None
        calls = [(r, c) for r in results if not r.failed for c in r.calls if c.completion_token_ids]
        hp = self.spec.hyper_parameters
        top_k = hp.teacher_top_k
        notes = [note for r in results if not r.failed for note in hindsight_notes(r, hp.teacher_hindsight)]
        noted_calls = [(c, note) for (_, c), note in zip(calls, notes, strict=True)]
        inputs = teacher_inputs(self._tokenizer, noted_calls, self._max_length)
        teacher = await self._teacher.score_top_k_many(inputs.pairs, top_k)
        return [
            dataclasses.replace(
                c,
                teacher_logprobs=scores.logprobs.tolist(),
                group_id=r.group_id,
                rollout_id=r.index,
                reward=r.reward,
                teacher_top_ids=scores.top_ids if top_k else None,
                teacher_top_logprobs=scores.top_logprobs if top_k else None,
                teacher_saw_note=noted,
            )
            for (r, c), scores, noted in zip(calls, teacher, inputs.noted, strict=True)
        ]

    def _minibatches(self, segments: list[LLMCall]) -> list[list[LLMCall]]:
        """Mini-batches of `ppo_mini_batch_size` rollouts; a rollout's segments stay together."""
        size = self.spec.hyper_parameters.ppo_mini_batch_size
        rollouts = sorted({s.rollout_id for s in segments})
        chunks = [set(rollouts[i : i + size]) for i in range(0, len(rollouts), size)]
        return [[s for s in segments if s.rollout_id in chunk] for chunk in chunks]

    def _next_batch(self, step: int) -> tuple[list[Sample], list[int]]:
        hp = self.spec.hyper_parameters
        samples = [self.train_samples[i] for i in self.cursor.next_batch(hp.batch_size)]
        return samples, [request_seed(hp.seed, step, index) for index in range(len(samples) * hp.n_rollouts)]

    def _sample_and_score(
        self, samples: list[Sample], step: int, seeds: list[int]
    ) -> tuple[asyncio.Task[list[RolloutResult]], asyncio.Task[list[LLMCall]]]:
        """Starts a batch's rollouts; the teacher scores each rollout as soon as it ends, not when
        the whole batch ends. Returns the rollouts' task and the scored segments' (rollout order)."""
        assert self._runner is not None
        scoring: dict[int, asyncio.Task[list[LLMCall]]] = {}

        def score(result: RolloutResult) -> None:
            if not result.failed:
                scoring[id(result)] = asyncio.create_task(self._segments([result]))

        rollouts = asyncio.create_task(
            self._runner.run(samples, self.spec.hyper_parameters.n_rollouts, step, seeds, on_result=score)
        )

        async def scored() -> list[LLMCall]:
            try:
                results = await rollouts
            finally:
                if not rollouts.done() or rollouts.cancelled() or rollouts.exception() is not None:
                    for task in scoring.values():
                        task.cancel()
            parts = await asyncio.gather(
                *(scoring[id(r)] for r in results if id(r) in scoring), return_exceptions=True
            )
            for part in parts:
                if isinstance(part, BaseException):
                    raise part
            return [segment for part in parts for segment in part]  # type: ignore[union-attr]

        return rollouts, asyncio.create_task(scored())

    def _start_next_step(self, step: int) -> NextStep:
        """Samples step `step`'s rollouts now, with the weights the engines hold; the teacher scores
        each as soon as it is done. The cursor state before the batch is kept for checkpoints (used
        when the batch is started a step early)."""
        cursor = self.cursor.state()
        samples, seeds = self._next_batch(step)
        return NextStep(cursor, *self._sample_and_score(samples, step, seeds))

    async def train_one_step(self) -> dict[str, float]:
        """One step: rollouts, teacher scores, a learner update, weights to the student engines.

        With `max_staleness: 0` each phase waits for the one before. With `max_staleness >= 1` the
        next step's rollouts are sampled (and scored by the teacher) while this step's learner update
        runs, with the weights the engines hold, one version behind the learner by the time they are
        trained on; the learner's importance ratio (sampler logprobs, capped) corrects for it. The
        engines finish those rollouts before new weights reach them, so no completion mixes versions.
        """
        assert self._learner is not None and self._student is not None and self._runner is not None
        hp = self.spec.hyper_parameters
        step = self.step
        started = time.perf_counter()
        timer = time.perf_counter()
        if self._next is not None:  # sampled during the previous step
            upcoming, self._next = self._next, None
        else:
            upcoming = self._start_next_step(step)
        try:
            results = await upcoming.rollouts
            rollout_s = time.perf_counter() - timer
            timer = time.perf_counter()
            self.log.trajectories([r.trajectory(step + 1) for r in results[:TRAJECTORIES_PER_STEP]])
            rollout_metrics = rollout_step_metrics(results, has_rewards=bool(self.spec.reward_components))
            failed = rollout_metrics["failed_rollouts"]
            if rollout_metrics["failed_ratio"] > hp.max_failed_ratio or failed == len(results):
                raise OPDError(
                    f"step {step + 1}: {failed:.0f}/{len(results)} rollouts failed "
                    f"(max_failed_ratio={hp.max_failed_ratio}); first error: {failure_message(results)}"
                )
        except BaseException:
            await self._cancel(upcoming)
            raise
        if hp.max_staleness > 0 and step + 1 < self.total_steps and not self._stop_requested:
            self._next = self._start_next_step(step + 1)
        # Scoring started as each rollout ended: what is timed here is the teacher's tail.
        segments = await upcoming.scored
        teacher_s = time.perf_counter() - timer
        staleness = [step - s.weight_version for s in segments]
        if hp.max_staleness > 0:
            segments = [s for s, lag in zip(segments, staleness, strict=True) if lag <= hp.max_staleness]
        hindsight_metrics: dict[str, float] = {}
        if hp.teacher_hindsight != "none":
            hindsight_metrics["hindsight/teacher_note_share"] = mean([s.teacher_saw_note for s in segments])
        if hp.hindsight_coef > 0:
            values = hindsight_advantages(segments)
            segments = [dataclasses.replace(s, hindsight=v) for s, v in zip(segments, values, strict=True)]
            hindsight_metrics["hindsight/turns_up"] = float(sum(v > 0 for v in values))
            hindsight_metrics["hindsight/turns_down"] = float(sum(v < 0 for v in values))
        timer = time.perf_counter()
        learner_metrics = await self._learner.train_step(self._minibatches(segments))
        learner_s = time.perf_counter() - timer
        timer = time.perf_counter()
        if self._next is not None:  # new weights only once the engines finished the next rollouts
            await asyncio.wait([self._next.rollouts])
        next_wait_s = time.perf_counter() - timer
        timer = time.perf_counter()
        await self._publish_weights(step + 1)
        sync_s = time.perf_counter() - timer
        self.step = step + 1
        step_s = time.perf_counter() - started
        trained_tokens = sum(len(s.completion_token_ids) for s in segments)
        engine_metrics = await self._engine_metrics()  # after the step's timers: not part of a phase
        metrics = {
            **reverse_kl_metrics(
                [s.sampler_logprobs for s in segments], [s.teacher_logprobs or [] for s in segments]
            ),
            **rollout_metrics,
            **learner_metrics,
            **pool_metrics(self._pools),
            **engine_metrics,
            **hindsight_metrics,
            "segments": float(len(segments)),
            "trained_tokens": float(trained_tokens),
            "tokens_per_s": trained_tokens / step_s,
            "staleness/mean": mean(staleness),
            "staleness/max": float(max(staleness, default=0)),
            "staleness/dropped_segments": float(len(staleness) - len(segments)),
            "time/rollout_s": rollout_s,
            "time/teacher_s": teacher_s,
            "time/learner_s": learner_s,
            "time/next_rollouts_wait_s": next_wait_s,
            "time/sync_s": sync_s,
            "time/step_s": step_s,
        }
        metrics["time/other_s"] = step_s - rollout_s - teacher_s - learner_s - next_wait_s - sync_s
        return metrics

    async def _engine_metrics(self) -> dict[str, float]:
        """`engine/ROLE/KEY` of both engine groups (`EngineGroup.stats`: totals so far, peaks since the
        previous step)."""
        assert self._student is not None and self._teacher is not None
        roles = {"student": self._student, "teacher": self._teacher}
        stats = await asyncio.gather(*(group.stats() for group in roles.values()))
        return {
            f"engine/{role}/{key}": value
            for role, numbers in zip(roles, stats, strict=True)
            for key, value in numbers.items()
        }

    async def _drop_next_step(self) -> None:
        """Ends the next step's rollouts (stop, failure): they are sampled again after a resume."""
        upcoming, self._next = self._next, None
        if upcoming is not None:
            await self._cancel(upcoming)

    @staticmethod
    async def _cancel(upcoming: NextStep) -> None:
        for task in (upcoming.rollouts, upcoming.scored):
            task.cancel()
        await asyncio.gather(upcoming.rollouts, upcoming.scored, return_exceptions=True)

    # -- evaluation -----------------------------------------------------------------------------

    async def evaluate(self, policy: str, label: str) -> dict[str, float]:
        """One validation pass of `policy` ("student" or "teacher"); see the module docstring."""
        assert self._teacher is not None and self._student is not None
        samples = self.validation_samples
        if not samples:
            return {}
        runner = self._runner if policy == "student" else self._teacher_runner
        assert runner is not None
        hp = self.spec.hyper_parameters
        seeds = [request_seed(hp.seed, -1, i) for i in range(len(samples))]
        tag = "eval-" + "".join(c if c.isalnum() else "-" for c in label)
        results, reverse_kl = await asyncio.gather(
            runner.validate(samples, tag, seeds),
            self._validation_reverse_kl() if policy == "student" else asyncio.sleep(0, 0.0),
        )
        metrics = validation_metrics(results, has_rewards=bool(self.spec.reward_components))
        if reverse_kl is not None:  # None: task records only, no prompt to sample on
            metrics["reverse_kl"] = reverse_kl
        succeeded = success_by_threshold(hp.eval_success_threshold)
        metrics |= agent_metrics(results, succeeded)
        if hp.eval_pass_k > 1:
            k = hp.eval_pass_k
            sampled = await runner.validate(
                samples,
                f"{tag}-pass",
                [request_seed(hp.seed, -2, i) for i in range(len(samples) * k)],
                per_sample=k,
                temperature=hp.eval_temperature,
            )
            groups = [sampled[i * k : (i + 1) * k] for i in range(len(samples))]
            metrics[f"agent/pass_at_{k}"] = pass_at_k(groups, succeeded)
        failures = scoring_failures(results)
        if failures:
            shown = ", ".join(f"{f['sample_id']} ({f['error'][:120]})" for f in failures[:REPORTED_FAILURES])
            self.emit(
                "eval_failures",
                f"{label}: {len(failures)}/{len(results)} validation samples could not be scored: {shown}",
                label=label,
                failures=failures[:REPORTED_FAILURES],
                count=len(failures),
            )
        self.emit(
            "eval",
            f"{label}: " + ", ".join(f"{k}={v:.3f}" for k, v in sorted(metrics.items())),
            label=label,
            **metrics,
        )
        return metrics

    async def _validation_reverse_kl(self) -> float | None:
        """Mean `logp_student − logp_teacher` per token of seeded student samples on validation prompts.

        Sampled at the job's temperature straight from the student engines (no user code), so it
        estimates the same reverse KL the training signal minimises, on prompts it never trains on.
        """
        assert self._teacher is not None and self._student is not None
        hp = self.spec.hyper_parameters
        # Task records have no prompt of their own (a workflow writes it): they take no part here.
        prompts = [self._prompt(s) for s in self.validation_samples if s.messages]
        if not prompts:
            return None
        sampled = await self._student.generate_many(
            prompts,
            seeds=[request_seed(hp.seed, -1, i) for i in range(len(prompts))],
            max_tokens=hp.max_tokens,
            temperature=hp.temperature,
        )
        scored = [c for c in sampled if c.completion_token_ids]
        teacher = await self._teacher.score_many(
            [(c.prompt_token_ids, c.completion_token_ids) for c in scored]
        )
        return reverse_kl_metrics([c.sampler_logprobs for c in scored], teacher)["reverse_kl"]

    # -- checkpoints ----------------------------------------------------------------------------

    async def save_checkpoint(self) -> Path:
        assert self._learner is not None
        staging = self.checkpoints.staging(self.step)
        await self._learner.save_checkpoint(str(staging))
        # With the next step's rollouts under way the cursor is one batch ahead: the checkpoint keeps
        # the state before that batch, which a resume samples again.
        cursor = self._next.cursor if self._next is not None else self.cursor.state()
        state = {"step": self.step, "cursor": cursor, "total_steps": self.total_steps}
        path = self.checkpoints.commit(staging, self.step, state)
        self.emit("checkpoint", f"saved step {self.step}", step=self.step, path=str(path))
        return path

    async def _resume_if_possible(self) -> bool:
        latest = self.checkpoints.latest()
        if latest is None:
            return False
        assert self._learner is not None and self._student is not None
        path, state = latest
        await self._learner.load_checkpoint(str(path))
        self.step = int(state["step"])
        self.cursor.restore(state["cursor"])
        discarded = self.log.truncate_after(self.step)
        await self._publish_weights(self.step)
        # Step events of discarded steps stay in the event log (ids are never reused); this event names
        # them. Metrics, curves and trajectories keep only the checkpointed steps.
        message = f"resumed from checkpoint at step {self.step}"
        if discarded:
            message += f"; steps {discarded[0]}-{discarded[-1]} after it are discarded and redone"
        self.emit("status", message, step=self.step, discarded_steps=discarded)
        return True

    # -- the loop -------------------------------------------------------------------------------

    async def run(self, stop_after: int | None = None) -> dict[str, Any]:
        """Trains to the end (or `stop_after` steps / a stop request) and returns the summary."""
        self.status = "running"
        self._started_at = time.time()
        try:
            self._load_data()
            self._report_ignored_fields()
            self._trackers = await asyncio.to_thread(open_trackers, self.spec, self.log, self.job_id)
            await self._start_components()
            assert self._student is not None and self._teacher is not None and self._learner is not None
            resumed = await self._resume_if_possible()
            summary = self.log.load_summary() if resumed else {}
            if not resumed:
                probe = await self._probe_segments()
                drift = await check_drift(self._learner, probe, self.spec.hyper_parameters.max_drift)
                self.emit(
                    "preflight",
                    f"learner/sampler drift mean {drift['mean']:.2e} max {drift['max']:.2e}",
                    **drift,
                )
                if self.validation_samples:
                    summary["teacher"] = await self.evaluate("teacher", "teacher")
                    summary["student_before"] = await self.evaluate("student", "student before")
                    self._record("eval", 0, summary["student_before"])
                self.log.save_summary(summary)
            hp = self.spec.hyper_parameters
            self.emit("status", f"training {self.total_steps} steps", total_steps=self.total_steps)
            while self.step < self.total_steps:
                metrics = await self.train_one_step()
                self._latest = metrics
                self._record("train", self.step, metrics)
                self.emit(
                    "step",
                    f"step {self.step}/{self.total_steps} reverse_kl={metrics['reverse_kl']:.4f} "
                    f"tokens/s={metrics['tokens_per_s']:.0f}",
                    step=self.step,
                    total_steps=self.total_steps,
                    **{k: metrics[k] for k in ("reverse_kl", "loss", "tokens_per_s")},
                )
                if (
                    self.validation_samples
                    and self.step % hp.eval_steps == 0
                    and self.step < self.total_steps
                ):
                    self._record("eval", self.step, await self.evaluate("student", f"step {self.step}"))
                stopping = self._stop_requested or (stop_after is not None and self.step >= stop_after)
                if self.step % hp.save_steps == 0 or stopping:
                    await self.save_checkpoint()
                if stopping:
                    self.status = "stopped"
                    self.emit("status", f"stopped after step {self.step}", step=self.step)
                    return summary
            if self.validation_samples:
                summary["student_after"] = await self.evaluate("student", "student after")
                self._record("eval", self.step, summary["student_after"])
            if self.checkpoints.latest_step() != self.step:
                await self.save_checkpoint()
            self.log.save_summary(summary)
            self.status = "succeeded"
            self.emit("status", "succeeded", step=self.step)
            return summary
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
        path = self.log.events_path
        lines = path.read_text().splitlines() if path.exists() else []
        if any("ignored_fields" in json.loads(line).get("data", {}) for line in lines if line):
            return
        self.emit(
            "warning",
            "ignored Bailian-only fields, they have no meaning here: " + ", ".join(sorted(ignored)),
            ignored_fields=ignored,
        )

    async def _probe_segments(self) -> list[LLMCall]:
        """A few student samples, to compare the learner's logprobs with the sampler's (drift)."""
        assert self._student is not None
        hp = self.spec.hyper_parameters
        samples = [s for s in self.train_samples if s.messages][:4]  # task records have no prompt
        prompts = [self._prompt(s) for s in samples]
        completions = await self._student.generate_many(
            prompts,
            seeds=[request_seed(hp.seed, -2, i) for i in range(len(prompts))],
            max_tokens=hp.max_tokens,
            temperature=hp.temperature,
        )
        return [
            dataclasses.replace(c, teacher_logprobs=c.sampler_logprobs, group_id=index, rollout_id=index)
            for index, c in enumerate(completions)
            if c.completion_token_ids
        ]


JobDriverActor = ray.remote(JobDriver)
"""`JobDriver` as a Ray actor: one per job."""
