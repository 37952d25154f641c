"""One training step, phase by phase: sample → score → shape → learn → publish.

`train_step` is the whole step; each phase is a function of its own returning what the next needs and
its metrics:

- **sample** (`Sampler`, `collect_rollouts`): a batch of prompts from the data cursor, `n_rollouts`
  rollouts each through the user's rollout code and the recording gateway, with the weights the engines
  hold; the rollout's reward comes from the user's reward workers. With `max_staleness` k >= 1 the next
  k steps' batches are sampled while this step learns: k = 1 waits for the next batch before publishing
  (it is exactly one version behind); k >= 2 publishes without waiting, so sampling runs on through the
  updates and each call keeps the version it was sampled with (at most k behind when it is trained).
- **score** (`score`): every recorded LLM call of a successful rollout becomes a segment the teacher
  scored on exactly the student's tokens (`signal.scores.score_rollouts`), started as soon as each
  rollout ends (`sample_and_score`), not when the batch ends; the phase waits for the last of them.
- **shape** (`shape`): the training signal (`signal.shape.shape_signal`): drops stale segments and
  rollouts leaking a hindsight note's wording, adds the hindsight values and the preference pairs, and
  with `beacon_rewrite` the turns written again with a hindsight beacon, paired against themselves.
- **learn** (`learn`): the learner's update on mini-batches of whole rollouts (`minibatches`).
- **publish** (`publish`): the new weights to every student replica (`Components.publish_weights`).

`StepClock` times a step from one step's start to the next's, so a step's bookkeeping is never left
out of the clock that samples/s and tokens/s divide by.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from opd_trainer.driver.components import Components
from opd_trainer.errors import OPDError
from opd_trainer.jobspec.dataset import EpochCursor, Sample
from opd_trainer.jobspec.job_spec import HyperParameters
from opd_trainer.records import LLMCall
from opd_trainer.rollout.runner import RolloutResult, failure_message, rollout_step_metrics
from opd_trainer.rollout.trajectory_view import scored_trajectories
from opd_trainer.seeds import request_seed
from opd_trainer.signal.beacons import BeaconModels
from opd_trainer.signal.pairs import pairs_split_across
from opd_trainer.signal.scores import score_rollouts
from opd_trainer.signal.shape import shape_signal
from opd_trainer.signal.shaped import Shaped
from opd_trainer.stats import mean
from opd_trainer.storage.run_dir import RunDir
from opd_trainer.workers.pool import pool_metrics

TRAJECTORIES_PER_STEP = 16

Scorer = Callable[[list[RolloutResult]], Awaitable[list[LLMCall]]]


def reverse_kl_metrics(
    sampler_logprobs: list[list[float]], teacher_logprobs: list[list[float]]
) -> dict[str, float]:
    """Reverse KL, teacher/student logprob and entropy estimate over every token of the given calls
    (`learner.loss.distillation_metrics`; the one place the driver measures reverse KL)."""
    # torch on use: the job server imports this package's launcher, never torch (see driver/launch.py).
    import torch

    from opd_trainer.learner.loss import distillation_metrics

    sampler_1_T = torch.tensor([[lp for row in sampler_logprobs for lp in row]])
    teacher_1_T = torch.tensor([[lp for row in teacher_logprobs for lp in row]])
    return distillation_metrics(sampler_1_T, teacher_1_T, torch.ones_like(sampler_1_T))


class StepClock:
    """Seconds from one step's start to the next's. `lap()` ends a step and starts the next, so what a
    step does after its lap (its records, trackers, events) counts in the step after it; validation and
    checkpoints between steps run inside `excluded()` and are left out."""

    def __init__(self) -> None:
        self._mark = time.perf_counter()
        self._excluded = 0.0

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed = now - self._mark - self._excluded
        self._mark, self._excluded = now, 0.0
        return elapsed

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self._excluded += time.perf_counter() - started


# -- sample -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Batch:
    """A step's rollouts under way and the teacher's scores of them (segments in rollout order)."""

    step: int  # the step (0-based) that trains it
    cursor: dict[str, Any]  # the data cursor before this batch was taken
    rollouts: asyncio.Task[list[RolloutResult]]
    scored: asyncio.Task[list[LLMCall]]

    async def cancel(self) -> None:
        for task in (self.rollouts, self.scored):
            task.cancel()
        await asyncio.gather(self.rollouts, self.scored, return_exceptions=True)


def sample_and_score(
    runner: Any, score: Scorer, samples: list[Sample], step: int, seeds: list[int], n_rollouts: int
) -> tuple[asyncio.Task[list[RolloutResult]], asyncio.Task[list[LLMCall]]]:
    """Starts a batch's rollouts; `score` runs on each successful rollout as soon as it ends. Returns
    the rollouts' task and the scored segments' (rollout order). A failed batch cancels the scoring."""
    scoring: dict[int, asyncio.Task[list[LLMCall]]] = {}

    def on_result(result: RolloutResult) -> None:
        if not result.failed:
            scoring[id(result)] = asyncio.create_task(score([result]))

    rollouts = asyncio.create_task(runner.run(samples, n_rollouts, step, seeds, on_result=on_result))

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


class Sampler:
    """Takes batches from the training data in cursor order; holds the batches sampled ahead, oldest
    first."""

    def __init__(self, components: Components, samples: list[Sample], cursor: EpochCursor) -> None:
        self.components = components
        self.samples = samples
        self.cursor = cursor
        self.ahead: collections.deque[Batch] = collections.deque()

    def start(self, step: int) -> Batch:
        """Samples step `step`'s batch now, with the weights the engines hold."""
        c, hp = self.components, self.components.spec.hyper_parameters
        cursor = self.cursor.state()
        batch = [self.samples[i] for i in self.cursor.next_batch(hp.batch_size)]
        seeds = [request_seed(hp.seed, step, index) for index in range(len(batch) * hp.n_rollouts)]

        async def scored(results: list[RolloutResult]) -> list[LLMCall]:
            return await score_rollouts(c.teachers, c.tokenizer, c.max_length, hp, results)

        return Batch(step, cursor, *sample_and_score(c.runner, scored, batch, step, seeds, hp.n_rollouts))

    def take(self, step: int) -> Batch:
        """The batch sampled ahead for `step`, else a new one."""
        if self.ahead:
            batch = self.ahead.popleft()
            assert batch.step == step, f"the batch sampled ahead is step {batch.step}'s, not {step}'s"
            return batch
        return self.start(step)

    def sample_ahead(self, after: int, last: int) -> None:
        """Starts the batches of the steps after `after` up to `last` that are not under way yet."""
        first = self.ahead[-1].step + 1 if self.ahead else after + 1
        for step in range(first, last + 1):
            self.ahead.append(self.start(step))

    def cursor_state(self) -> dict[str, Any]:
        """What a checkpoint keeps: with batches sampled ahead, the state before the first of them (a
        resume samples them again)."""
        return self.ahead[0].cursor if self.ahead else self.cursor.state()

    async def drop_ahead(self) -> None:
        """Ends the batches sampled ahead (stop, failure): they are sampled again after a resume."""
        batches, self.ahead = list(self.ahead), collections.deque()
        for batch in batches:
            await batch.cancel()


async def collect_rollouts(
    batch: Batch, step: int, hp: HyperParameters, has_rewards: bool, log: RunDir
) -> tuple[list[RolloutResult], dict[str, float]]:
    """Waits for a batch's rollouts and fails the step when more rollouts failed than
    `max_failed_ratio` allows (or all did), recording the first trajectories of such a step as they
    are (a step that goes on records them once scored: `train_step`)."""
    try:
        results = await batch.rollouts
        metrics = rollout_step_metrics(results, has_rewards=has_rewards)
        failed = metrics["failed_rollouts"]
        if metrics["failed_ratio"] > hp.max_failed_ratio or failed == len(results):
            log.trajectories([r.trajectory(step + 1) for r in results[:TRAJECTORIES_PER_STEP]])
            raise OPDError(
                f"step {step + 1}: {failed:.0f}/{len(results)} rollouts failed "
                f"(max_failed_ratio={hp.max_failed_ratio}); first error: {failure_message(results)}"
            )
    except BaseException:
        await batch.cancel()
        raise
    return results, metrics


# -- score ------------------------------------------------------------------------------------------


async def score(batch: Batch) -> list[LLMCall]:
    """The batch's segments as the teacher scored them, in rollout order. Scoring started as each
    rollout ended (`sample_and_score`): what is left to wait for here is the teacher's tail."""
    return await batch.scored


def per_teacher_metrics(segments: list[LLMCall]) -> dict[str, float]:
    """`teacher/NAME/KEY` for each teacher that scored `segments` (the step's trained ones): its
    `segments`, `scored_tokens` (prompt + completion), `reverse_kl` over its segments' tokens and the mean
    `latency_s` of its scoring requests (a step's records carry them when a job has several teachers)."""
    names = sorted({s.teacher_name for s in segments})
    metrics: dict[str, float] = {}
    for name in names:
        own = [s for s in segments if s.teacher_name == name]
        kl = reverse_kl_metrics([s.sampler_logprobs for s in own], [s.teacher_logprobs or [] for s in own])
        metrics.update(
            {
                f"teacher/{name}/segments": float(len(own)),
                f"teacher/{name}/scored_tokens": float(
                    sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in own)
                ),
                f"teacher/{name}/reverse_kl": kl["reverse_kl"],
                f"teacher/{name}/latency_s": mean([s.teacher_latency_s for s in own]),
            }
        )
    return metrics


# -- shape ------------------------------------------------------------------------------------------


async def shape(c: Components, results: list[RolloutResult], segments: list[LLMCall], step: int) -> Shaped:
    """The step's training signal from its scored segments (`signal.shape.shape_signal`): the segments
    to train on, the beacons' rewrites and the staleness/hindsight/preference/beacons metrics."""
    hp = c.spec.hyper_parameters
    models = None
    if hp.beacon_rewrite != "off":
        models = BeaconModels(
            c.teachers, c.student, c.tokenizer, c.max_length, c.spec.tool_call_parser, c.beacon_pool
        )
    return await shape_signal(segments, step, hp, results, models)


def record(log: RunDir, results: list[RolloutResult], shaped: Shaped, tokenizer: Any, step: int) -> None:
    """The first trajectories with the teacher's view of each trained token (failed rollouts and calls
    whose segment was dropped have none) and the beacons' rewrites beside their turns. Each distinct id
    is decoded once: 16 trajectories of 3 x 512 tokens took 30-100 ms with the JSON written, on a busy
    2-core CPU."""
    shown = results[:TRAJECTORIES_PER_STEP]
    log.trajectories(scored_trajectories(shown, shaped.segments, tokenizer, step + 1, shaped.rewrites))


# -- learn ------------------------------------------------------------------------------------------


def minibatches(segments: list[LLMCall], size: int) -> list[list[LLMCall]]:
    """Mini-batches of `size` rollouts (`ppo_mini_batch_size`); a rollout's segments stay together."""
    rollouts = sorted({s.rollout_id for s in segments})
    chunks = [set(rollouts[i : i + size]) for i in range(0, len(rollouts), size)]
    return [[s for s in segments if s.rollout_id in chunk] for chunk in chunks]


async def learn(c: Components, shaped: Shaped, mark: StepMark) -> dict[str, float]:
    """The learner's update on the step's segments and rewrites, in mini-batches of whole rollouts; its
    metrics, with `preference/split_pairs` where the job mines pairs."""
    hp = c.spec.hyper_parameters
    updates = minibatches(shaped.segments + shaped.rewrites, hp.ppo_mini_batch_size)
    split: dict[str, float] = {}
    if hp.turn_preference_coef > 0:
        split["preference/split_pairs"] = float(pairs_split_across(updates))
    mark.learner_started = True
    return {**await c.learner.train_step(updates), **split}


# -- publish ----------------------------------------------------------------------------------------


async def publish(c: Components, step: int) -> dict[str, float]:
    """The learner's new weights (version `step + 1`) to every student replica; `sync_bytes`: the
    weights (or a LoRA job's adapter) handed to the engines."""
    return {"sync_bytes": float(await c.publish_weights(step + 1))}


# -- the step ---------------------------------------------------------------------------------------


class _Phases:
    """Seconds per phase of one step, read in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._mark = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[f"time/{phase}_s"] = now - self._mark
        self._mark = now


@dataclasses.dataclass
class StepMark:
    """How far the step under way got, for a checkpoint the driver takes when the step fails: the data
    cursor before its batch, and whether the learner has begun its update (after which the learner's
    state is no longer the previous step's)."""

    cursor: dict[str, Any] | None = None
    learner_started: bool = False


async def train_step(
    c: Components,
    sampler: Sampler,
    step: int,
    *,
    sample_ahead_to: int,
    clock: StepClock,
    log: RunDir,
    mark: StepMark | None = None,
) -> dict[str, float]:
    """Step `step` (0-based) end to end; returns its metrics. `sample_ahead_to`: the last step whose
    batch may be sampled while this one learns (`step + max_staleness`, at most the last step; `step`:
    none). `mark`: kept up to date with how far the step got.

    No completion mixes weight versions: with `max_staleness` 1 the engines finish the batch sampled
    ahead before new weights reach them; with more, an engine update waits for the completions under
    way and admits none meanwhile (`Engine.update_weights`). The learner's importance ratio (sampler
    logprobs, capped) corrects for the lag, and `stale_divergence` what the lag does to `sampled`'s
    signal.
    """
    hp = c.spec.hyper_parameters
    phases = _Phases()
    mark = mark if mark is not None else StepMark()
    batch = sampler.take(step)
    mark.cursor = batch.cursor
    results, rollout_metrics = await collect_rollouts(
        batch, step, hp, has_rewards=bool(c.spec.reward_components), log=log
    )
    phases.done("rollout")
    sampler.sample_ahead(step, sample_ahead_to)
    segments = await score(batch)
    phases.done("teacher")
    shaped = await shape(c, results, segments, step)
    if hp.beacon_rewrite != "off":
        phases.done("beacons")
    record(log, results, shaped, c.tokenizer, step)
    phases.done("record")  # the signal phase and the recorded trajectories, apart from the learner's time
    learner_metrics = await learn(c, shaped, mark)
    phases.done("learner")
    if sampler.ahead and hp.max_staleness == 1:  # new weights once the engines finished the next batch
        await asyncio.wait([sampler.ahead[0].rollouts])
    phases.done("next_rollouts_wait")
    published = await publish(c, step)
    phases.done("sync")
    engine_metrics = await c.engine_metrics()
    step_s = clock.lap()
    trained = shaped.segments
    trained_tokens = sum(len(s.completion_token_ids) for s in trained)
    forwarded_tokens = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in trained)
    metrics = {
        **reverse_kl_metrics(
            [s.sampler_logprobs for s in trained], [s.teacher_logprobs or [] for s in trained]
        ),
        **rollout_metrics,
        **learner_metrics,
        **pool_metrics(c.pools),
        **engine_metrics,
        **shaped.metrics,
        "staleness/batches_ahead": float(len(sampler.ahead)),
        **(per_teacher_metrics(trained) if c.teachers.several else {}),
        "segments": float(len(trained)),
        **published,
        "trained_tokens": float(trained_tokens),
        "forwarded_tokens": float(forwarded_tokens),
        "tokens_per_s": trained_tokens / step_s,
        "samples_per_s": len(results) / step_s,
        **phases.seconds,
        "time/step_s": step_s,
    }
    metrics["time/other_s"] = step_s - sum(phases.seconds.values())
    return metrics
