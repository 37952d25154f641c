"""A job's running parts: started once, handed to every phase as one frozen `Components`.

`start_components` starts the engines (student, teacher: through the job's `EngineFleet`,
`engine/fleet.py`), the learner, the recording gateways (where `rollout/gateway_placement.py` puts them:
in the student's engine process) and the user's worker pools, and returns them only when all are up.
A LoRA job whose one teacher is its student's model (`teacher_model: self`) starts no teacher engine:
the teacher is the student's engines' base model (`student_base_teacher`).
Everything it starts is registered in a `Started` as soon as it exists, so `Started.stop()` stops what a
start-up that failed half-way left running as well as a finished job's parts.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import ray
import torch
from transformers import AutoTokenizer

from opd_trainer.chat import prompt_token_ids
from opd_trainer.driver.publish import publish_adapter, publish_weights
from opd_trainer.driver.teachers import TeacherEngines
from opd_trainer.engine.adapters import BASE_MODEL_CLIENT, OWN_JOB
from opd_trainer.engine.engine_sharing import EngineSharing
from opd_trainer.engine.fleet import EngineFleet
from opd_trainer.engine.vllm_engine import EngineConfig, EngineGroup, EnginePlacement
from opd_trainer.errors import ConfigError, ProcessorLoadError
from opd_trainer.jobspec.base_teacher import teacher_is_student_base
from opd_trainer.jobspec.dataset import Sample
from opd_trainer.jobspec.job_spec import EngineResources, FunctionComponent, JobSpec
from opd_trainer.jobspec.memory_plan import check_memory_plan, unplannable
from opd_trainer.jobspec.preflight import preflight_models
from opd_trainer.learner.deepspeed_learner import LearnerGroup
from opd_trainer.learner.settings import LearnerSettings
from opd_trainer.rollout.gateway_host import GatewayRef
from opd_trainer.rollout.gateway_placement import place_gateways, start_own_process
from opd_trainer.rollout.runner import STUDENT_MODEL_NAME, TEACHER_MODEL_NAME, AuxiliaryModel, RolloutRunner
from opd_trainer.weight_sync.transports import check_transfer_available
from opd_trainer.workers.pool import user_code_resources
from opd_trainer.workers.sandbox import (
    SandboxUnavailable,
    configured_mode,
    configured_network,
    effective_mode,
    unconfined_reason,
)
from reward_workers.beacon_pool import BeaconPool
from reward_workers.pool import RewardPool
from rollout_workers.pool import RolloutPool

Emit = Callable[..., None]
"""`emit(kind, message, **data)`: one job event."""


@dataclasses.dataclass(frozen=True)
class Components:
    """What a running job holds. `teacher_runner` exists when the job validates (the teacher's
    baseline runs through the same rollout, reward and evaluator code as the student's)."""

    spec: JobSpec
    job_id: str
    tokenizer: Any
    max_length: int
    student: EngineGroup
    teachers: TeacherEngines
    learner: LearnerGroup
    weight_transfers: tuple[str, ...]  # the handoff kind of each student replica
    runner: RolloutRunner
    teacher_runner: RolloutRunner | None
    pools: tuple[Any, ...]
    gateways: tuple[Any, ...]  # a gateway host actor of its own, if any (not when in the student's process)
    beacon_pool: BeaconPool | None  # the user's beacon writer (`signal/beacons.py`), if the job has one

    def prompt(self, sample: Sample) -> list[int]:
        return prompt_token_ids(self.tokenizer, sample.messages, sample.tools, self.spec.chat_template_kwargs)

    async def publish_weights(self, version: int) -> int:
        """The learner's weights to every student replica, each by its handoff kind; a LoRA job's
        adapter instead (one `AdapterHandoff` every replica loads). Returns the bytes handed off."""
        if self.spec.hyper_parameters.lora is not None:
            return await publish_adapter(self.learner, self.student, version)
        return await publish_weights(self.learner, self.student, list(self.weight_transfers), version)

    async def engine_metrics(self) -> dict[str, float]:
        """`engine/ROLE/KEY` of the student's and the teachers' engines (`EngineGroup.stats`: totals so
        far, peaks since the previous call; `TeacherEngines.stats` for the teachers' roles)."""
        student, teachers = await asyncio.gather(self.student.stats(), self.teachers.stats())
        roles = {"student": student, **teachers}
        return {
            f"engine/{role}/{key}": value for role, numbers in roles.items() for key, value in numbers.items()
        }


@dataclasses.dataclass
class Started:
    """Everything start-up has started so far, for `stop()`; pools also feed the live pool metrics."""

    gateways: list[Any] = dataclasses.field(default_factory=list)  # gateway host actors of their own
    fleet: EngineFleet | None = None  # the job's engines, own and shared
    learner: LearnerGroup | None = None
    pools: list[Any] = dataclasses.field(default_factory=list)
    runners: list[RolloutRunner] = dataclasses.field(default_factory=list)

    @property
    def engines(self) -> list[EngineGroup]:
        """The engine groups the job started itself (not the shared ones it holds)."""
        return list(self.fleet.groups) if self.fleet is not None else []

    async def stop(self) -> None:
        """Stops all of it, in parallel (vLLM engines take seconds each). Shared engines are released,
        not stopped (`EngineFleet.stop`); gateways in an engine's process stop with it."""
        for runner in self.runners:
            await runner.close()
        stops: list[Awaitable[Any]] = [pool.shutdown() for pool in self.pools]
        if self.fleet is not None:
            stops.append(self.fleet.stop())
        stops += [gateway.shutdown.remote() for gateway in self.gateways]
        await asyncio.gather(*stops, return_exceptions=True)
        for gateway in self.gateways:
            ray.kill(gateway)
        if self.learner is not None:
            self.learner.shutdown()
        self.gateways, self.fleet, self.pools, self.runners, self.learner = [], None, [], [], None


async def start_components(
    spec: JobSpec,
    job_id: str,
    *,
    validates: bool,
    total_updates: int,
    started: Started,
    emit: Emit,
    server: bool,
    run_dir: Path,
    storage_token: str | None,
    teacher_sharing: EngineSharing | None = None,
    student_sharing: EngineSharing | None = None,
) -> Components:
    """Starts the job's parts into `started` and returns them together. `validates`: the job has
    validation data (a teacher runner and evaluator pool); `total_updates`: learner updates of the
    whole job (the learning-rate schedule's length); `teacher_sharing`: the teachers' engines come
    from the cluster's shared ones (`engine/shared_engines.py`), None: the job starts its own;
    `student_sharing`: so does a LoRA job's student (a full-training job's never: its weights change)."""
    hp = spec.hyper_parameters
    sandbox = _sandbox_options(spec, server)
    max_length = preflight_models(hp.max_length, spec.weight_sources())
    # Refused here, before any engine starts, when the roles' memory exceeds the placement's.
    plan = check_memory_plan(spec, max_length, shared_teachers=teacher_sharing is not None)
    if plan is None:
        emit("status", f"no memory plan: {unplannable(spec)}")
    else:
        emit("status", f"memory plan: {plan.total_bytes / 1024**3:.2f} GiB for every role, fits")
    tokenizer = AutoTokenizer.from_pretrained(spec.model, trust_remote_code=False)
    world_size = max(1, spec.resources.learner_gpus)
    _check_rank_split(spec, world_size)
    try:  # before any engine starts: cuda_ipc / nccl cannot run on this machine
        check_transfer_available(spec.resources.weight_transfer, torch.cuda.is_available())
    except ValueError as exc:
        raise ConfigError(str(exc), field="resources.weight_transfer") from None
    emit("status", "starting engines and learner")
    if hp.lora is None:
        student_sharing = None  # full training changes the student's weights: its engines are its own
    # The gateways (vLLM's request validation and tool-call parser: an import of vLLM) run in the
    # student's engine process (`rollout/gateway_placement.py`); a shared student's job starts a
    # process of their own now, so its import overlaps the engines' start.
    serves_teacher = validates or bool(spec.auxiliary_models)
    models = _gateway_models(spec, serves_teacher)
    options = _gateway_options(spec, max_length)
    own_process = start_own_process(models, options) if student_sharing is not None else None
    if own_process is not None:
        started.gateways.append(own_process)
    student, teachers, learner = await _start_engines_and_learner(
        spec, job_id, (max_length, total_updates, world_size), started, (teacher_sharing, student_sharing)
    )
    if student_base_teacher(spec, student_sharing):
        message = (
            "the teacher is the student's base model, scored on the student's engines without the "
            "adapter: no teacher engine started"
        )
        emit("status", message, teacher_engines="student", engine_groups=len(started.engines))
    placed = await place_gateways(models, options, student, own_process)
    transfers = await _learner_handoffs(spec, student, learner, (run_dir, storage_token), emit)
    gateway = placed.ref(STUDENT_MODEL_NAME)
    base_url = await placed.serve(STUDENT_MODEL_NAME, student)
    pools = await _start_pools(spec, job_id, validates, sandbox, started, emit)
    teacher_side: tuple[GatewayRef | None, str | None] = (None, None)
    if serves_teacher:
        teacher_url = await placed.serve(TEACHER_MODEL_NAME, teachers.default)
        teacher_side = (placed.ref(TEACHER_MODEL_NAME), teacher_url)
    runner, teacher_runner = _runners(spec, job_id, (gateway, base_url), teacher_side, pools, validates)
    started.runners.extend(r for r in (runner, teacher_runner) if r is not None)
    return Components(
        spec=spec,
        job_id=job_id,
        tokenizer=tokenizer,
        max_length=max_length,
        student=student,
        teachers=teachers,
        learner=learner,
        weight_transfers=tuple(transfers),
        runner=runner,
        teacher_runner=teacher_runner,
        pools=tuple(started.pools),
        gateways=tuple(started.gateways),
        beacon_pool=pools.beacon,
    )


async def _learner_handoffs(
    spec: JobSpec, student: EngineGroup, learner: LearnerGroup, storage: tuple[Path, str | None], emit: Emit
) -> list[str]:
    """Every learner rank sees the run dir (`storage`: it and the probe token, if any); returns each
    student replica's weight transport (`resources.weight_transfer` against where they landed)."""
    run_dir, storage_token = storage
    if storage_token is not None:
        await learner.check_storage(str(run_dir), storage_token)
    try:
        transfers = await student.transfers(spec.resources.weight_transfer, await learner.node_id())
    except ValueError as exc:
        raise ConfigError(str(exc), field="resources.weight_transfer") from None
    how = ", ".join(sorted(set(transfers)))
    if spec.hyper_parameters.lora is not None:
        how = "adapter (LoRA: each step's adapter files, loaded as a new LoRARequest)"
    emit("status", f"student weights reach the engines by {how}", weight_transfers=transfers)
    return transfers


async def all_or_none(*parts: Awaitable[Any]) -> list[Any]:
    """`asyncio.gather` that cancels the other parts when one fails (gather leaves them running): an
    engine still starting when the learner's placement failed would otherwise come up after the job
    stopped what it had, and hold its resources until the driver ends."""
    tasks = [asyncio.ensure_future(part) for part in parts]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _start_engines_and_learner(
    spec: JobSpec,
    job_id: str,
    sizes: tuple[int, int, int],
    started: Started,
    sharing: tuple[EngineSharing | None, EngineSharing | None],
) -> tuple[EngineGroup, TeacherEngines, LearnerGroup]:
    """The student's and every teacher's engine groups and the learner ranks, started side by side.
    `sizes`: max length, learner updates of the whole job, learner ranks; `sharing`: the teachers' and
    the students' (`start_components`)."""
    max_length, total_updates, world_size = sizes
    teacher_sharing, student_sharing = sharing
    on_student = student_base_teacher(spec, student_sharing)
    fleet = started.fleet = EngineFleet(job_id)
    learner = LearnerGroup(
        LearnerSettings.from_spec(spec, total_updates),
        world_size,
        spec.resources.learner_gpu_fraction if torch.cuda.is_available() else 0.0,
        placement_timeout_s=spec.resources.placement_timeout_s,
        ray_resources=spec.resources.learner_ray_resources,
    )
    started.learner = learner

    async def engines(model: str, resources: EngineResources, role: str, name: str) -> EngineGroup:
        config = _engine_config(spec, max_length, model, resources, role)
        if on_student:  # the student's engines score as the teacher too: its top-k limit
            config = config.model_copy(update={"max_logprobs": max(20, spec.hyper_parameters.teacher_top_k)})
        role_sharing = teacher_sharing if role == "teacher" else student_sharing
        if role_sharing is not None:
            return await fleet.acquire(config, role_sharing, role)
        return await fleet.start(config, f"{job_id}-{name}")

    teachers = spec.teachers
    if on_student:
        # One engine group, two clients: the student samples with its adapter (`OWN_JOB`), the teacher
        # (the default and only one) runs the base model (`BASE_MODEL_CLIENT`); each reads its own counts.
        own, _ = await all_or_none(
            engines(spec.model, spec.resources.student, "student", "student"), learner.initialize()
        )
        student, base = fleet.split(own, [OWN_JOB, BASE_MODEL_CLIENT])
        return student, TeacherEngines(spec, {teachers[0].name: base}), learner
    # One teacher keeps the actor name `JOB-teacher`; several are `JOB-teacher.NAME`.
    names = ["teacher"] if len(teachers) == 1 else [f"teacher.{t.name}" for t in teachers]
    student, teacher_groups, _ = await all_or_none(
        engines(spec.model, spec.resources.student, "student", "student"),
        all_or_none(
            *(
                engines(t.model, spec.resources.teacher, "teacher", n)
                for t, n in zip(teachers, names, strict=True)
            )
        ),
        learner.initialize(),
    )
    groups = dict(zip((t.name for t in teachers), teacher_groups, strict=True))
    return student, TeacherEngines(spec, groups), learner


def student_base_teacher(spec: JobSpec, student_sharing: EngineSharing | None) -> bool:
    """Whether the job's teacher runs on its student's engines as their base model
    (`jobspec/base_teacher.py`): only where those engines are the job's own. A student shared with other
    LoRA jobs (`student_sharing`) keeps a teacher engine of its own (or a shared one)."""
    return student_sharing is None and teacher_is_student_base(spec)


def _runners(
    spec: JobSpec,
    job_id: str,
    student: tuple[GatewayRef, str],
    teacher: tuple[GatewayRef | None, str | None],
    pools: _Pools,
    validates: bool,
) -> tuple[RolloutRunner, RolloutRunner | None]:
    """The student's rollout runner, and with `validates` the teacher's (its validation baseline).
    Both run the same rollout, reward and evaluator pools; every rollout gets the teacher as each
    auxiliary model the job names."""
    hp = spec.hyper_parameters
    teacher_gateway, teacher_url = teacher
    auxiliary: dict[str, AuxiliaryModel] = {}
    if teacher_gateway is not None and teacher_url is not None:
        teacher_model = AuxiliaryModel(teacher_gateway, teacher_url, TEACHER_MODEL_NAME)
        # every value of auxiliary_models is "teacher", the only model served
        auxiliary = dict.fromkeys(spec.auxiliary_models, teacher_model)
    options: dict[str, Any] = {
        "max_tokens": hp.max_tokens,
        "temperature": hp.temperature,
        "rollout_pool": pools.rollout,
        "reward_pools": pools.rewards,
        "evaluator_pool": pools.evaluator,
        "auxiliary_models": auxiliary,
    }
    runner = RolloutRunner(job_id, *student, **options)
    teacher_runner = None
    if teacher_gateway is not None and teacher_url is not None and validates:
        teacher_runner = RolloutRunner(job_id, teacher_gateway, teacher_url, **options)
    return runner, teacher_runner


def _sandbox_options(spec: JobSpec, server: bool) -> dict[str, Any]:
    """The pools' sandbox options. Where user code runs on this node too (no user-code group), a job
    whose code cannot run confined stops here, before any engine starts; every worker checks again on
    its own node."""
    if not spec.functions:
        return {}
    mode = configured_mode()
    if not user_code_resources():
        try:
            effective_mode(mode, server=server)
        except SandboxUnavailable as exc:
            raise ProcessorLoadError(str(exc), field="functions") from None
    return {"sandbox_mode": mode, "sandbox_network": configured_network(), "server": server}


def _check_rank_split(spec: JobSpec, world_size: int) -> None:
    """Mini-batches are split across ranks by prompt group: each needs a group per rank."""
    hp = spec.hyper_parameters
    rollouts = hp.batch_size * hp.n_rollouts
    smallest = min(hp.ppo_mini_batch_size, rollouts % hp.ppo_mini_batch_size or hp.ppo_mini_batch_size)
    if smallest < world_size * hp.n_rollouts:
        raise ConfigError(
            f"with {world_size} learner ranks every mini-batch needs {world_size} prompt groups "
            f"({world_size * hp.n_rollouts} rollouts); the smallest of this job's has {smallest}",
            field="hyper_parameters.ppo_mini_batch_size",
        )


def _engine_config(
    spec: JobSpec, max_length: int, model: str, resources: EngineResources, role: str
) -> EngineConfig:
    """The engine's own settings for `model` in `role`, from the job spec."""
    hp = spec.hyper_parameters
    sequences = hp.batch_size * hp.n_rollouts
    return EngineConfig(
        model=model,
        max_model_len=max_length,
        resources=EnginePlacement(**resources.model_dump()),
        seed=hp.seed,
        concurrent_sequences=sequences,
        role=role,
        # vLLM refuses a request for more top-k logprobs than this; 20 is its own default.
        max_logprobs=max(20, hp.teacher_top_k) if role == "teacher" else 20,
        placement_timeout_s=spec.resources.placement_timeout_s,
        # A LoRA job's student engines serve its adapter, loaded anew each step (`engine/adapters.py`).
        lora_rank=hp.lora.r if hp.lora is not None and role == "student" else None,
    )


def _gateway_models(spec: JobSpec, serves_teacher: bool) -> dict[str, str]:
    """The gateways a job runs: the student's, and with `serves_teacher` the default teacher's (the
    name each answers as -> the model, for its tokenizer)."""
    models = {STUDENT_MODEL_NAME: spec.model}
    if serves_teacher:
        models[TEACHER_MODEL_NAME] = spec.default_teacher_model
    return models


def _gateway_options(spec: JobSpec, max_length: int) -> dict[str, Any]:
    hp = spec.hyper_parameters
    return {
        "max_tokens": hp.max_tokens,
        "temperature": hp.temperature,
        "max_length": max_length,
        "tool_call_parser": spec.tool_call_parser,
        "chat_template_kwargs": spec.chat_template_kwargs,
    }


@dataclasses.dataclass(frozen=True)
class _Pools:
    rollout: Any
    rewards: list[Any]
    evaluator: Any
    beacon: BeaconPool | None


async def _start_pools(
    spec: JobSpec, job_id: str, validates: bool, sandbox: dict[str, Any], started: Started, emit: Emit
) -> _Pools:
    """The user's worker pools (rollout, rewards, the evaluator when the job validates, the beacon
    writer)."""

    def on_event(event: dict[str, Any]) -> None:
        message = f"{event['pool']}: {event['from']} -> {event['to']} workers ({event['reason']})"
        emit("autoscale", message, **{k: v for k, v in event.items() if k != "type"})

    options: dict[str, Any] = {"on_event": on_event, **sandbox}
    rollout = None
    for component in spec.rollout_components:
        rollout = RolloutPool(job_id, component, _workspace(component), **options)
    rewards = [RewardPool(job_id, c, _workspace(c), **options) for c in spec.reward_components]
    evaluator = None
    if validates:
        for component in spec.evaluator_components:
            evaluator = RewardPool(job_id, component, _workspace(component), **options)
    beacon = None
    for component in spec.beacon_components:
        beacon = BeaconPool(job_id, component, _workspace(component), **options)
    pools = [p for p in (rollout, *rewards, evaluator, beacon) if p is not None]
    started.pools.extend(pools)
    if pools:
        emit("status", "loading user processors: " + ", ".join(p.component.name for p in pools))
    await asyncio.gather(*(pool.start() for pool in pools))
    for pool in pools:
        emit("status", f"{pool.component.name} runs in {pool.confinement}", sandbox=pool.confinement)
        if (pool.confinement or "").startswith("no sandbox"):
            message = f"{pool.component.name}: user processors run without a sandbox: {unconfined_reason()}"
            emit("warning", message, sandbox="none")
    return _Pools(rollout, rewards, evaluator, beacon)


def _workspace(component: FunctionComponent) -> Path:
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
