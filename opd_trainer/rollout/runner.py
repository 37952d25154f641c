"""A step's rollouts: sampled through the recording gateway, then rewarded by the reward components.

Model OPD (no rollout component): the built-in rollout is one chat completion per (prompt, rollout)
with the sample's messages and tools, sent to the gateway like any client would — one sampling path.
Agentic OPD: the user's rollout processor runs in the rollout pool and calls the gateway itself, any
number of times, with the per-rollout key it was given; the step's rollouts go to the pool together
(one Ray call per worker) and each comes back as it ends, with the calls its key recorded (its worker
closed the key, `opd_trainer/recorded_calls.py`); the built-in rollout's one request closes its key
and brings its record back too. Either way the gateway's record of each call becomes one training
segment; keys nobody closed yet (the auxiliary models', a rollout whose call or worker was lost) the
runner closes over the gateway's close route.

Task reward R = Σ_c weight_c · (reward_score_c + Σ_m reward_metric_weight_c[m] · reward_metrics_c[m]);
`ground_truth` is `rollout_extra.ground_truth`, else `rollout_extra.solution`. Failed rollouts
(FAILED status, `ROLLOUT_ERROR:` content, timeout, no recorded call, a record the gateway no longer
holds) and rollouts whose reward failed are counted and carry no loss.

Validation runs the same rollouts (one per sample, greedy) and, when the job has an evaluator
component, scores each with it too; `validation_metrics` aggregates what every job has (rewards,
the evaluator's metrics) and `reward_failures` names the samples that could not be rewarded or scored.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from opd_trainer.jobspec.dataset import Sample, ground_truth_of
from opd_trainer.jobspec.job_spec import FunctionComponent
from opd_trainer.recorded_calls import CLOSE_SECRET_HEADER, close_keys, decode_with_record
from opd_trainer.records import LLMCall
from opd_trainer.rollout.gateway import RolloutKeyRequest
from opd_trainer.rollout.gateway_host import GatewayRef
from opd_trainer.rollout.trajectory_view import CallTokens, mean_log_ratio
from opd_trainer.sdk import PROMPT_MESSAGES_KEY, AgentOutput, ModelResource, TaskStatus, is_rollout_failure
from opd_trainer.stats import mean
from rollout_workers.pool import RolloutRequest

if TYPE_CHECKING:
    from collections.abc import Callable

    from reward_workers.pool import RewardPool
    from rollout_workers.pool import RolloutAnswer, RolloutPool

logger = logging.getLogger(__name__)

STUDENT_MODEL_NAME = "student"
TEACHER_MODEL_NAME = "teacher"  # the name the teacher's gateway answers under (baseline, auxiliary model)
RolloutKeys = tuple[str, dict[str, ModelResource]]  # a rollout's student key and its auxiliary models
CLIENT_KEEPALIVE_S = 15.0
"""How long the built-in rollout keeps an idle connection to the gateway. Shorter than the gateway's own
keep-alive (`gateway.KEEP_ALIVE_S`), so the pool drops an idle connection before the server may close
it: aiohttp checks the idle time against the clock when it hands a connection out, so this holds even
when the driver's event loop was too busy to read the server's FIN."""
LOST_RECORD = (
    "the gateway no longer holds its key's record (closed before the records it keeps, or expired): "
    "the calls it made are unknown"
)
"""A rollout's error when neither its answer nor the runner's own close brought its record: it fails
(counted, never trained as a rollout that made no call)."""


async def _body_unsent(tracker: aiohttp.UploadTracker) -> bool:
    """Whether the request body provably did not leave this process in full.

    aiohttp (>= 3.14) settles `upload_complete` with a result once the whole body was handed to the
    transport, and fails it otherwise: the write refused because the connection was already closing
    (the server's FIN on a pooled keep-alive connection, read between taking the connection and
    writing the body: "Can not write request body"), a write or flush that failed or was cancelled with
    bytes still queued (the transport drops them with the connection), or a body never begun (the
    connection could not be made). A body the gateway did not receive in full was never acted on: it
    reads the whole JSON body before it opens, samples or records anything (`await raw.json()` in
    `Gateway.app`), and a connection that ends short of the Content-Length is a disconnect to it.
    The future settles when the body writer ends, within a loop turn or two of the error; one that has
    not settled after 5 s counts as sent."""
    done, _ = await asyncio.wait({tracker.upload_complete}, timeout=5.0)
    return bool(done) and tracker.upload_complete.exception() is not None


async def post_json(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, bytes]:
    """POSTs `body` as JSON; returns the answer's status and bytes. A transport error is retried once
    when the request provably never reached the server (`_body_unsent`), and never otherwise: after
    the body was written (the server disconnected while we awaited the answer, a reset while reading
    it, a timeout) the gateway may have sampled and recorded the call, and a retry would record — and
    train on — a second completion the rollout never saw."""
    for attempt in (1, 2):
        tracker = aiohttp.UploadTracker()
        try:
            async with http.post(url, json=body, headers=headers, upload_tracker=tracker) as response:
                return response.status, await response.read()
        except aiohttp.ClientConnectionError as exc:
            # A timeout spent the request's whole budget: not retried even when nothing was sent.
            if attempt == 2 or isinstance(exc, asyncio.TimeoutError) or not await _body_unsent(tracker):
                raise
            logger.info("%s: the request never reached it (%r); retried once", url, exc)
    raise AssertionError("unreachable: the second attempt returns or raises")


@dataclass(frozen=True)
class AuxiliaryModel:
    """A model served to processors besides the student (job field `auxiliary_models`): a gateway of its
    own (in the job's gateway host), whose recorded calls are dropped when the rollout ends (never
    trained, never scored)."""

    gateway: GatewayRef
    base_url: str
    model_name: str


@dataclass
class RolloutResult:
    """Everything one rollout produced; `index` is its integer id within the step."""

    group_id: int
    index: int
    rollout_id: str
    sample: Sample
    calls: list[LLMCall] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""
    attempt_id: int = 0
    reward: float = 0.0
    component_rewards: dict[str, float] = field(default_factory=dict)
    reward_metrics: dict[str, float] = field(default_factory=dict)
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    spans: list[dict[str, Any]] = field(default_factory=list)
    agent_output: AgentOutput | None = None
    eval_score: float | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)
    eval_error: str = ""
    auxiliary_calls: int = 0

    @property
    def failed(self) -> bool:
        return bool(self.error) or not any(call.completion_token_ids for call in self.calls)

    def trajectory(self, step: int, tokens: list[CallTokens | None] | None = None) -> dict[str, Any]:
        """A JSON-able view for the job's trajectory log. `tokens`: per recorded call (in call order),
        its trained tokens as `call_tokens` gives them, None for a call that was not trained (failed
        rollout, no completion, a segment dropped as stale); each call's `tokens` holds it, and
        `divergence` is the mean log-ratio over the trajectory's trained tokens (None without any)."""
        per_call = tokens if tokens is not None else [None] * len(self.calls)
        return {
            "step": step,
            "rollout_id": self.rollout_id,
            "sample_id": self.sample.sample_id,
            "attempt_id": self.attempt_id,
            "failed": self.failed,
            "error": self.error[:2000],
            "messages": self.messages,
            "llm_calls": [
                {
                    "response": c.response_message,
                    "prompt_tokens": len(c.prompt_token_ids),
                    "completion_tokens": len(c.completion_token_ids),
                    "weight_version": c.weight_version,
                    "latency_s": c.latency_s,
                    "tokens": call_view,
                }
                for c, call_view in zip(self.calls, per_call, strict=True)
            ],
            "divergence": mean_log_ratio([t for t in per_call if t is not None]),
            "auxiliary_calls": self.auxiliary_calls,
            "reward": self.reward,
            "component_rewards": self.component_rewards,
            "reward_metrics": self.reward_metrics,
            "rollout_metrics": self.rollout_metrics,
            "spans": self.spans,
        }


def component_reward(component: FunctionComponent, reward_score: float, metrics: dict[str, float]) -> float:
    """weight · (reward_score + Σ reward_metric_weight[m] · metrics[m]) for one reward component."""
    extra = sum(w * metrics.get(name, 0.0) for name, w in (component.reward_metric_weight or {}).items())
    return component.weight * (reward_score + extra)


class RolloutRunner:
    """Runs a step's rollouts against one job's gateway, rollout pool and reward pools."""

    def __init__(
        self,
        job_id: str,
        gateway: GatewayRef,
        base_url: str,
        *,
        max_tokens: int,
        temperature: float,
        rollout_pool: RolloutPool | None = None,
        reward_pools: list[RewardPool] | None = None,
        evaluator_pool: RewardPool | None = None,
        auxiliary_models: dict[str, AuxiliaryModel] | None = None,
    ) -> None:
        self.job_id = job_id
        self.gateway = gateway
        self.base_url = base_url
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.rollout_pool = rollout_pool
        self.reward_pools = reward_pools or []
        self.evaluator_pool = evaluator_pool
        self.auxiliary_models = auxiliary_models or {}
        self._http: aiohttp.ClientSession | None = None
        self._close_secrets: dict[str, str] = {}  # each gateway's (by base URL), asked once

    def _session(self) -> aiohttp.ClientSession:
        """The built-in rollout's HTTP client, made on the driver's event loop at first use. aiohttp, not
        httpx: httpx's pool checks every idle connection's socket on each request; with a step's
        rollouts in flight the driver spent 12.5 ms of CPU a rollout on httpx, 1.4 ms on aiohttp
        (`benchmarks/rollout_gateway.py`)."""
        if self._http is None:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=600.0),
                connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=CLIENT_KEEPALIVE_S),
            )
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def _builtin(self, result: RolloutResult, key: str, seed: int) -> list[LLMCall] | None:
        """One chat completion, sent with the gateway's close secret: the key ends with it and the answer
        carries its recorded calls, returned (None when the call failed: `_sample_and_reward` closes
        the key then)."""
        sample = result.sample
        body: dict[str, Any] = {
            "model": STUDENT_MODEL_NAME,
            "messages": sample.messages,
            "seed": seed,
            "max_tokens": self.max_tokens,
        }
        if sample.tools:
            body["tools"] = sample.tools
        headers = {"Authorization": f"Bearer {key}", CLOSE_SECRET_HEADER: self._close_secrets[self.base_url]}
        status, answer = await post_json(self._session(), f"{self.base_url}/chat/completions", body, headers)
        if status != 200:
            result.error = f"gateway answered {status}: {answer.decode(errors='replace')[:500]}"
            return None
        completion, calls = decode_with_record(answer)
        # vLLM's message lists every field, most of them null (refusal, audio, ...): the conversation
        # keeps those that are set, as an OpenAI client's `model_dump(exclude_none=True)` does.
        message = {k: v for k, v in completion["choices"][0]["message"].items() if v is not None}
        result.messages = [*sample.messages, message]
        # Rewards see where the given conversation ends, as they do after an agentic rollout that
        # follows the same convention (examples/tool_routing_agentic): the reply is what they judge.
        result.agent_output = AgentOutput(
            messages=result.messages,
            rollout_extra={**sample.rollout_extra, PROMPT_MESSAGES_KEY: len(sample.messages)},
        )
        return calls

    def _agentic(
        self, results: list[RolloutResult], seeds: list[int], keys: list[RolloutKeys]
    ) -> list[Awaitable[RolloutAnswer]]:
        """The rollouts of `results`, submitted to the rollout pool together (`RolloutPool.rollouts`)."""
        assert self.rollout_pool is not None
        requests = [
            RolloutRequest(
                sample_id=result.sample.sample_id,
                rollout_id=result.rollout_id,
                messages=result.sample.messages,
                tools=result.sample.tools,
                ground_truth=ground_truth_of(result.sample),
                rollout_extra=result.sample.rollout_extra,
                sampling_params={
                    "temperature": self.temperature,
                    "max_tokens": self.max_tokens,
                    "seed": seed,
                },
                model_resource=ModelResource(
                    model_name=STUDENT_MODEL_NAME, base_url=self.base_url, api_key=key
                ),
                auxiliary_models=auxiliary,
            )
            for result, seed, (key, auxiliary) in zip(results, seeds, keys, strict=True)
        ]
        return self.rollout_pool.rollouts(requests, self._close_secrets[self.base_url])

    @staticmethod
    async def _agentic_result(
        result: RolloutResult, answer: Awaitable[RolloutAnswer]
    ) -> list[LLMCall] | None:
        """Fills `result` with its rollout's answer; returns the calls its worker collected, if any."""
        rollout = await answer
        output = rollout.output
        result.spans, result.attempt_id = rollout.spans, rollout.attempt_id
        result.agent_output = output.agent_output
        if output.agent_output is not None:
            result.messages = output.agent_output.messages
            result.rollout_metrics = dict(output.agent_output.rollout_metrics)
        if is_rollout_failure(output):
            result.error = output.error or "rollout reported failure"
        return rollout.calls

    def _sample(
        self, results: list[RolloutResult], seeds: list[int], keys: list[RolloutKeys]
    ) -> list[Awaitable[list[LLMCall] | None]]:
        """Starts each rollout: one awaitable per result that fills it and returns the calls its key
        recorded when it has them already (an agentic rollout's worker closed the key), else None."""
        if self.rollout_pool is None:
            return [
                self._builtin(r, key, seed) for r, seed, (key, _) in zip(results, seeds, keys, strict=True)
            ]
        answers = self._agentic(results, seeds, keys)
        return [self._agentic_result(r, answer) for r, answer in zip(results, answers, strict=True)]

    async def _learn_close_secrets(self) -> None:
        """Each gateway's close secret (`GatewayRef.close_secret`), asked once."""
        gateways = {self.base_url: self.gateway}
        gateways |= {model.base_url: model.gateway for model in self.auxiliary_models.values()}
        for base_url, gateway in gateways.items():
            if base_url not in self._close_secrets:
                self._close_secrets[base_url] = await gateway.close_secret()

    async def _close(self, base_url: str, key: str) -> list[LLMCall] | None:
        """Closes `key` on the gateway at `base_url`; its recorded calls, None when the gateway no longer
        knows the key (`recorded_calls.close_keys`)."""
        [calls] = await close_keys(self._session(), base_url, self._close_secrets[base_url], [key])
        return calls

    async def _open_keys(
        self, rollout_ids: list[str], seeds: list[int], temperature: float | None
    ) -> list[RolloutKeys]:
        """For each rollout, its student key (sampling at `temperature`, None: the job's) and a greedy key
        per auxiliary model, opened in one Ray call per gateway rather than one per rollout (and, the
        first time, each gateway's close secret)."""
        await self._learn_close_secrets()
        student = await self.gateway.open_rollouts(
            [RolloutKeyRequest(r, temperature, seed) for r, seed in zip(rollout_ids, seeds, strict=True)]
        )
        auxiliary: list[dict[str, ModelResource]] = [{} for _ in rollout_ids]
        for name, model in self.auxiliary_models.items():
            keys = await model.gateway.open_rollouts(
                [RolloutKeyRequest(r, 0.0, seed) for r, seed in zip(rollout_ids, seeds, strict=True)]
            )
            for resources, key in zip(auxiliary, keys, strict=True):
                resources[name] = ModelResource(
                    model_name=model.model_name, base_url=model.base_url, api_key=key
                )
        return list(zip(student, auxiliary, strict=True))

    async def _one(
        self,
        result: RolloutResult,
        sampling: Awaitable[list[LLMCall] | None],
        keys: RolloutKeys,
        *,
        validating: bool = False,
    ) -> RolloutResult:
        """One rollout under way (`_sample`) with its keys (see `_open_keys`), rewarded (and, when
        validating, evaluated); its keys are closed when it ends."""
        key, auxiliary = keys
        try:
            await self._sample_and_reward(result, sampling, key, auxiliary, validating)
        finally:
            result.auxiliary_calls = await self._close_auxiliary(auxiliary)
        return result

    async def _sample_and_reward(
        self,
        result: RolloutResult,
        sampling: Awaitable[list[LLMCall] | None],
        key: str,
        auxiliary: dict[str, ModelResource],
        validating: bool,
    ) -> None:
        recorded: list[LLMCall] | None = None
        try:
            recorded = await sampling
        except Exception as exc:  # one broken rollout must not fail the step
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            if recorded is None:  # nobody closed its key yet, or the answer that carried its record was lost
                recorded = await self._close(self.base_url, key)
            if recorded is None:
                logger.warning("[%s] %s: its key's record is gone", self.job_id, result.rollout_id)
                result.error = result.error or LOST_RECORD
            result.calls = recorded or []
        if result.failed:
            return
        # The evaluator first: a reward that fails must not hide the sample from the evaluator.
        if validating and self.evaluator_pool is not None:
            await self._evaluate(result, auxiliary)
        await self._reward(result, auxiliary)

    async def _close_auxiliary(self, resources: dict[str, ModelResource]) -> int:
        """Ends the auxiliary keys; their recorded calls are counted and dropped."""
        calls = 0
        for name, resource in resources.items():
            base_url = self.auxiliary_models[name].base_url
            calls += len(await self._close(base_url, resource.api_key.get_secret_value()) or [])
        return calls

    async def _evaluate(self, result: RolloutResult, auxiliary: dict[str, ModelResource]) -> None:
        assert self.evaluator_pool is not None
        output, spans = await self.evaluator_pool.reward(
            sample_id=result.sample.sample_id,
            rollout_id=result.rollout_id,
            ground_truth=ground_truth_of(result.sample),
            agent_output=result.agent_output or AgentOutput(messages=result.messages),
            auxiliary_models=auxiliary,
        )
        result.spans.extend(spans)
        name = self.evaluator_pool.component.name
        if output.status == TaskStatus.FAILED or output.reward is None:
            result.eval_error = f"evaluator {name} failed: {output.error or 'no score'}"
            return
        values = {"eval_score": float(output.reward.reward_score)}
        values |= {k: float(v) for k, v in output.reward.reward_metrics.items()}
        bad = [k for k, v in values.items() if not math.isfinite(v)]
        if bad:
            result.eval_error = f"evaluator {name} returned non-finite {', '.join(bad)}"
            return
        result.eval_score = values.pop("eval_score")
        result.eval_metrics = values

    async def _reward(self, result: RolloutResult, auxiliary: dict[str, ModelResource]) -> None:
        agent_output = result.agent_output or AgentOutput(messages=result.messages)
        if not self.reward_pools:
            # A rollout processor may reward itself (Bailian's AgentOutput.reward_score).
            result.reward = float(agent_output.reward_score or 0.0)
            return
        outputs = await asyncio.gather(
            *(
                pool.reward(
                    sample_id=result.sample.sample_id,
                    rollout_id=result.rollout_id,
                    ground_truth=ground_truth_of(result.sample),
                    agent_output=agent_output,
                    auxiliary_models=auxiliary,
                )
                for pool in self.reward_pools
            )
        )
        total = 0.0
        for pool, (output, spans) in zip(self.reward_pools, outputs, strict=True):
            result.spans.extend(spans)
            name = pool.component.name
            if output.status == TaskStatus.FAILED or output.reward is None:
                result.error = f"reward {name} failed: {output.error or 'no reward'}"
                return
            value = float(output.reward.reward_score)
            if not math.isfinite(value):
                result.error = f"reward {name} returned a non-finite reward_score {value}"
                return
            metrics = {k: float(v) for k, v in output.reward.reward_metrics.items()}
            result.component_rewards[name] = value
            result.reward_metrics.update({f"{name}/{k}": v for k, v in metrics.items()})
            total += component_reward(pool.component, value, metrics)
        result.reward = total

    async def run(
        self,
        samples: list[Sample],
        n_rollouts: int,
        step: int,
        seeds: list[int],
        on_result: Callable[[RolloutResult], None] | None = None,
    ) -> list[RolloutResult]:
        """`n_rollouts` rollouts of every sample, all in flight at once; group id = sample position.

        `on_result` is called with each rollout as soon as it (and its rewards) are done, so that
        the caller can start on it (teacher scoring) while the others are still running.
        """
        results = self._results(samples, n_rollouts, f"s{step}")
        seeds = seeds[: len(results)]
        keys = await self._open_keys([r.rollout_id for r in results], seeds, None)
        sampling = self._sample(results, seeds, keys)

        async def one(
            result: RolloutResult, sampled: Awaitable[list[LLMCall] | None], rollout_keys: RolloutKeys
        ) -> RolloutResult:
            await self._one(result, sampled, rollout_keys)
            if on_result is not None:
                on_result(result)
            return result

        return list(await asyncio.gather(*(one(*job) for job in zip(results, sampling, keys, strict=True))))

    async def validate(
        self,
        samples: list[Sample],
        tag: str,
        seeds: list[int],
        *,
        per_sample: int = 1,
        temperature: float = 0.0,
    ) -> list[RolloutResult]:
        """`per_sample` rollouts of each sample (in sample order; group id = sample position), rewarded
        and scored by the evaluator (if any). Greedy by default, so the same weights always give the
        same validation numbers; pass@k samples at a temperature."""
        results = self._results(samples, per_sample, tag)
        seeds = seeds[: len(results)]
        keys = await self._open_keys([r.rollout_id for r in results], seeds, temperature)
        sampling = self._sample(results, seeds, keys)
        return list(
            await asyncio.gather(
                *(self._one(*job, validating=True) for job in zip(results, sampling, keys, strict=True))
            )
        )

    def _results(self, samples: list[Sample], per_sample: int, tag: str) -> list[RolloutResult]:
        """The (empty) results of `per_sample` rollouts of each sample: group id = sample position,
        index = position in the list."""
        jobs = [(group, sample) for group, sample in enumerate(samples) for _ in range(per_sample)]
        return [
            RolloutResult(group, index, f"{self.job_id}-{tag}-r{index}", sample)
            for index, (group, sample) in enumerate(jobs)
        ]


def rollout_step_metrics(results: list[RolloutResult], has_rewards: bool) -> dict[str, float]:
    """Failure counts, LLM calls, and reward / reward_metrics / rollout_metrics aggregated per step."""
    good = [r for r in results if not r.failed]
    metrics: dict[str, float] = {
        "rollouts": float(len(results)),
        "failed_rollouts": float(len(results) - len(good)),
        "failed_ratio": (len(results) - len(good)) / len(results) if results else 0.0,
        "llm_calls_per_rollout": mean([float(len(r.calls)) for r in good]),
    }
    if has_rewards and good:
        rewards = [r.reward for r in good]
        reward_mean = mean(rewards)
        metrics["reward_mean"] = reward_mean
        metrics["reward_std"] = math.sqrt(mean([(x - reward_mean) ** 2 for x in rewards]))
        for name in sorted({k for r in good for k in r.component_rewards}):
            metrics[f"reward/{name}"] = mean(
                [r.component_rewards[name] for r in good if name in r.component_rewards]
            )
    for source, prefix in (("reward_metrics", "reward"), ("rollout_metrics", "rollout")):
        names = sorted({k for r in good for k in getattr(r, source)})
        for name in names:
            values = [getattr(r, source)[name] for r in good if name in getattr(r, source)]
            metrics[f"{prefix}/{name}"] = mean(values)
    return metrics


def validation_metrics(
    results: list[RolloutResult], has_rewards: bool, has_evaluator: bool = False
) -> dict[str, float]:
    """Validation metrics over every sample. With an evaluator, its `eval_score` and its named metrics are
    means over all samples, where a sample the evaluator did not score (its rollout failed or was cut
    off without a completion, or the evaluator raised) counts as wrong: 0. `failed_samples` counts
    those samples, `scored_samples` the rest. Rewards (as in training, whose scale is the user's) are
    means over the samples their reward workers scored.
    """
    metrics: dict[str, float] = {
        "samples": float(len(results)),
        "failed_samples": float(sum(1 for r in results if r.failed or r.eval_error)),
    }
    good = [r for r in results if not r.failed]
    if has_rewards and good:
        metrics["reward_mean"] = mean([r.reward for r in good])
        for name in sorted({k for r in good for k in r.component_rewards}):
            metrics[f"reward/{name}"] = mean(
                [r.component_rewards[name] for r in good if name in r.component_rewards]
            )
        for name in sorted({k for r in good for k in r.reward_metrics}):
            metrics[f"reward/{name}"] = mean(
                [r.reward_metrics[name] for r in good if name in r.reward_metrics]
            )
    if has_evaluator and results:
        unscored = sum(1 for r in results if r.failed or r.eval_error or r.eval_score is None)
        metrics["scored_samples"] = float(len(results) - unscored)
        metrics["eval_score"] = mean([_scored(r, r.eval_score) for r in results])
        for name in sorted({k for r in results for k in r.eval_metrics}):
            metrics[name] = mean([_scored(r, r.eval_metrics.get(name)) for r in results])
    return metrics


def _scored(result: RolloutResult, value: float | None) -> float:
    """An evaluator's value of one sample; 0 (wrong) where the sample failed or was not scored."""
    return 0.0 if result.failed or result.eval_error or value is None else float(value)


def reward_failures(results: list[RolloutResult]) -> list[dict[str, str]]:
    """Each sample that failed its rollout, a reward or the evaluator: its id and the first error."""
    failures = []
    for r in results:
        errors = [e for e in (r.error, r.eval_error) if e]
        if r.failed and not errors:
            errors = ["no completion recorded"]
        if errors:
            failures.append({"sample_id": r.sample.sample_id, "error": "; ".join(errors)[:500]})
    return failures


def failure_message(results: list[RolloutResult]) -> str:
    first = next((r for r in results if r.failed), None)
    return "" if first is None else (first.error or "no completion recorded")[:1000]
