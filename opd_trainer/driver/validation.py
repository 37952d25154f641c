"""Validation and the drift probe: what the driver measures outside the training step.

Validation measures what every job has, never a particular task: the reverse KL to the teacher on
validation prompts (seeded student samples, scored by the teacher), and the job's own rollout, reward
and evaluator components run on one greedy rollout per validation sample, for the student and, as the
baseline, for the teacher (through a gateway of its own). A sample that fails, is cut off or cannot be
scored counts as wrong (`rollout.runner.validation_metrics`) and is named in an event; the job goes on.
The first rollouts of each pass are recorded for the console; the student's with the teacher's view of
every token it wrote (`validation_records`). Every sample's outcome in the student's greedy pass
(`validation_outcomes`: success, score, turns, tool calls, format) goes out in an `eval_outcomes`
event, so two runs on the same samples can be compared sample by sample (`RunDir.validation_outcomes`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from opd_trainer.driver.components import Components, Emit
from opd_trainer.driver.step import reverse_kl_metrics
from opd_trainer.jobspec.dataset import Sample
from opd_trainer.records import LLMCall
from opd_trainer.rollout.agent_eval import (
    Succeeded,
    _made_calls,
    _tool_results,
    _turn_succeeded,
    agent_metrics,
    is_tool_error,
    pass_at_k,
    success_by_threshold,
)
from opd_trainer.rollout.runner import RolloutResult, reward_failures, validation_metrics
from opd_trainer.rollout.trajectory_view import scored_trajectories
from opd_trainer.seeds import request_seed
from opd_trainer.signal.scores import score_rollouts

# Samples named in one validation's failure event (the count is always complete).
REPORTED_FAILURES = 20
# Seeds of the validation samples and of the drift probe: apart from every training step's.
VALIDATION_SEED_STEP = -1
PASS_AT_K_SEED_STEP = -2
PROBE_SEED_STEP = -2
# Rollouts of each validation pass recorded for the side-by-side view (the first, by sample order).
VALIDATION_TRAJECTORIES_PER_PASS = 16

Model = Literal["student", "teacher"]
# Handed a pass's recorded rollouts and, for the student's, their calls as the teacher scored them.
Recorder = Callable[[list[RolloutResult], list[LLMCall]], None]


def validation_records(
    results: list[RolloutResult],
    step: int,
    label: str,
    model: Model,
    scored: list[LLMCall] | None = None,
    tokenizer: Any = None,
) -> list[dict[str, Any]]:
    """The records of a validation pass's first `VALIDATION_TRAJECTORIES_PER_PASS` rollouts: each
    `RolloutResult.trajectory` with the pass's `label` and `model` after its `step`, and the
    evaluator's `eval_score` (None where it did not score the sample), `eval_metrics` and `eval_error`.

    `scored`: the student's calls as the teacher scored them (`score_rollouts`); each call then has
    its per-token view (`trajectory_view.CallTokens`: the student's greedy logprob − the teacher's of
    every token it wrote) and the record its `divergence`, as a step's trajectories do, though nothing
    of a validation rollout is trained. Without them (the teacher's own pass) both are None."""
    first = results[:VALIDATION_TRAJECTORIES_PER_PASS]
    if scored:
        trajectories = scored_trajectories(first, scored, tokenizer, step)
    else:
        trajectories = [result.trajectory(step) for result in first]
    records = []
    for result, trajectory in zip(first, trajectories, strict=True):
        del trajectory["step"]
        records.append(
            {
                "step": step,  # first: RunDir reads a line's step from its start
                "label": label,
                "model": model,
                **trajectory,
                "eval_score": result.eval_score,
                "eval_metrics": result.eval_metrics,
                "eval_error": result.eval_error[:2000],
            }
        )
    return records


def validation_outcomes(results: list[RolloutResult], succeeded: Succeeded) -> list[dict[str, Any]]:
    """One record per rollout of a greedy pass, in sample order, by the rules of `agent_metrics`:

    - `sample_id`; `success`: `succeeded` (the pass's `eval_success_threshold` on the evaluator's score,
      else the reward), False for a failed rollout, as `agent/task_success` counts it; `failed`;
    - `score`: the value judged (`eval_score`, else `reward`; None for a failed rollout), `reward`;
    - `turns` (LLM calls with a completion), `turns_succeeded` and `turns_format_valid` of them (the
      numerators of `agent/turn_success` and `agent/format_valid_turns`), `format_valid` (it has turns
      and every one is well formed);
    - `tool_calls` (the agent's own), `wrong_history`: the sample's given history holds a tool error
      (the subset of `agent/self_correction_success`)."""
    outcomes = []
    for result in results:
        verdict = succeeded(result)
        turns = [call for call in result.calls if call.completion_token_ids] if not result.failed else []
        answers = _tool_results(result) if not result.failed else {}
        outcomes.append(
            {
                "sample_id": result.sample.sample_id,
                "success": bool(verdict),
                "failed": result.failed,
                "score": None
                if verdict is None
                else (result.eval_score if result.eval_score is not None else result.reward),
                "reward": None if result.failed else result.reward,
                "turns": len(turns),
                "turns_succeeded": sum(_turn_succeeded(call, answers) for call in turns),
                "turns_format_valid": sum(call.format_valid for call in turns),
                "format_valid": bool(turns) and all(call.format_valid for call in turns),
                "tool_calls": len(_made_calls(result)) if not result.failed else 0,
                "wrong_history": any(
                    m.get("role") == "tool" and is_tool_error(m) for m in result.sample.messages
                ),
            }
        )
    return outcomes


async def teacher_view(c: Components, results: list[RolloutResult]) -> list[LLMCall]:
    """The calls of the student's recorded validation rollouts scored by the teacher each sample is
    routed to (its top-k where the job asks for it), on the exact tokens, without hindsight notes."""
    plain = c.spec.hyper_parameters.model_copy(update={"teacher_hindsight": "none"})
    return await score_rollouts(
        c.teachers, c.tokenizer, c.max_length, plain, results[:VALIDATION_TRAJECTORIES_PER_PASS]
    )


async def evaluate(
    c: Components,
    samples: list[Sample],
    label: str,
    emit: Emit,
    *,
    teacher: bool = False,
    record: Recorder | None = None,
) -> dict[str, float]:
    """One validation pass of the student (or with `teacher`, the teacher's baseline) over `samples`;
    emits an `eval` event (and `eval_failures` naming the samples that failed; for the student's pass,
    `eval_outcomes` with `validation_outcomes`) and returns the metrics.
    `record` is handed the pass's greedy rollouts (not pass@k's samples) as soon as they are scored,
    with, for the student's pass, its first rollouts' calls as the teacher scored them."""
    if not samples:
        return {}
    runner = c.teacher_runner if teacher else c.runner
    if runner is None:
        raise ValueError("the teacher's baseline needs the teacher runner, started only with validation data")
    hp = c.spec.hyper_parameters
    seeds = [request_seed(hp.seed, VALIDATION_SEED_STEP, i) for i in range(len(samples))]
    tag = "eval-" + "".join(ch if ch.isalnum() else "-" for ch in label)
    results, reverse_kl = await asyncio.gather(
        runner.validate(samples, tag, seeds),
        # The teacher's reverse KL to itself is 0 by definition.
        asyncio.sleep(0, 0.0) if teacher else validation_reverse_kl(c, samples),
    )
    if record is not None:
        record(results, [] if teacher else await teacher_view(c, results))
    spec = c.spec
    metrics = validation_metrics(results, bool(spec.reward_components), bool(spec.evaluator_components))
    if reverse_kl is not None:  # None: task records only, no prompt to sample on
        metrics["reverse_kl"] = reverse_kl
    succeeded = success_by_threshold(hp.eval_success_threshold)
    metrics |= agent_metrics(results, succeeded)
    if hp.eval_pass_k > 1:
        k = hp.eval_pass_k
        sampled = await runner.validate(
            samples,
            f"{tag}-pass",
            [request_seed(hp.seed, PASS_AT_K_SEED_STEP, i) for i in range(len(samples) * k)],
            per_sample=k,
            temperature=hp.eval_temperature,
        )
        groups = [sampled[i * k : (i + 1) * k] for i in range(len(samples))]
        metrics[f"agent/pass_at_{k}"] = pass_at_k(groups, succeeded)
    failures = reward_failures(results)
    if failures:
        shown = ", ".join(f"{f['sample_id']} ({f['error'][:120]})" for f in failures[:REPORTED_FAILURES])
        emit(
            "eval_failures",
            f"{label}: {len(failures)}/{len(results)} validation samples failed and count as wrong: {shown}",
            label=label,
            failures=failures[:REPORTED_FAILURES],
            count=len(failures),
        )
    if not teacher:
        outcomes = validation_outcomes(results, succeeded)
        won = sum(o["success"] for o in outcomes)
        message = f"{label}: {won}/{len(outcomes)} validation samples succeeded (per-sample outcomes)"
        emit("eval_outcomes", message, label=label, outcomes=outcomes)
    emit(
        "eval",
        f"{label}: " + ", ".join(f"{k}={v:.3f}" for k, v in sorted(metrics.items())),
        label=label,
        **metrics,
    )
    return metrics


async def validation_reverse_kl(c: Components, samples: list[Sample]) -> float | None:
    """Mean `logp_student − logp_teacher` per token of seeded student samples on validation prompts,
    each scored by the teacher its sample is routed to.

    Sampled at the job's temperature straight from the student engines (no user code), so it
    estimates the same reverse KL the training signal minimises, on prompts it never trains on.
    """
    hp = c.spec.hyper_parameters
    # Task records have no prompt of their own (a workflow writes it): they take no part here.
    prompted = [s for s in samples if s.messages]
    prompts = [c.prompt(s) for s in prompted]
    if not prompts:
        return None
    sampled = await c.student.generate_many(
        prompts,
        seeds=[request_seed(hp.seed, VALIDATION_SEED_STEP, i) for i in range(len(prompts))],
        max_tokens=hp.max_tokens,
        temperature=hp.temperature,
    )
    scored = [(s, call) for s, call in zip(prompted, sampled, strict=True) if call.completion_token_ids]
    pairs = [(call.prompt_token_ids, call.completion_token_ids) for _, call in scored]
    teacher = await c.teachers.score([c.teachers.name_for(s) for s, _ in scored], pairs)
    return reverse_kl_metrics([call.sampler_logprobs for _, call in scored], teacher)["reverse_kl"]


async def drift_probe_segments(c: Components, train_samples: list[Sample]) -> list[LLMCall]:
    """A few student samples, to compare the learner's logprobs with the sampler's (pre-flight drift)."""
    hp = c.spec.hyper_parameters
    samples = [s for s in train_samples if s.messages][:4]  # task records have no prompt
    completions = await c.student.generate_many(
        [c.prompt(s) for s in samples],
        seeds=[request_seed(hp.seed, PROBE_SEED_STEP, i) for i in range(len(samples))],
        max_tokens=hp.max_tokens,
        temperature=hp.temperature,
    )
    return [
        dataclasses.replace(call, teacher_logprobs=call.sampler_logprobs, group_id=index, rollout_id=index)
        for index, call in enumerate(completions)
        if call.completion_token_ids
    ]
