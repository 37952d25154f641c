"""Agent-level validation metrics, in the layers TurnSight (turn-level hindsight self-distillation)
evaluates tool-using agents by.

Computed by the trainer from what every rollout records (the gateway's LLM calls and the conversation
the rollout returned), so they hold for any task and any agent; `agent/` in the validation metrics:

- `format_valid_turns`: share of turns (LLM calls) whose reply was well formed (`LLMCall.format_valid`:
  not cut off by `max_tokens`; with tools offered, no call markup the parser could not read, every call
  naming an offered tool with a JSON object of arguments).
- `turn_success`: share of turns that were well formed and, in a trajectory where the agent runs tools
  (tool messages answer its own calls), whose tool calls each got a result that is not an error. A
  result is an error when the tool message has `status: "error"`, its content is a JSON object with a
  true `error` / `is_error`, or its text starts with "error" (LangChain's and LangGraph's convention);
  a call with no result there did not succeed. An agent whose answer *is* the call (it runs no tools)
  is judged on format alone.
- `task_success`: share of trajectories whose evaluator score (without an evaluator, reward) reaches
  `hyper_parameters.eval_success_threshold`.
- `tool_calls_per_trajectory`, and `cut_off_share`: trajectories of agents that run tools whose last
  turn asked for tools that never ran (the agent's loop ended before a final answer: a turn limit, a
  loop).
- `tool_call_accuracy` / `tool_name_accuracy`, for samples whose reference answer lists `tool_calls`
  (`{name, arguments}` or OpenAI's `{function: {name, arguments}}`): the trajectory made exactly those
  calls (as a multiset; arguments compared as JSON), or the same tool names.
- `pass@k` (with `hyper_parameters.eval_pass_k` = k > 1): share of prompts where at least one of k
  rollouts sampled at `eval_temperature` succeeded.
- Self-correction and loops (TurnSight's): `repeated_failing_call_share`, of trajectories of agents that
  run tools, the share that made a call again (same name and arguments) after it got an error;
  `recovery_after_error`, of the trajectories where one of the agent's own calls got an error, the
  share that still succeeded; `self_correction_success`, of the samples whose given history already
  holds a failed call (a tool message that is an error: a deliberately wrong history), the share the
  agent repaired (succeeded). Each only when its subset is not empty.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from opd_trainer.actions import canonical_tool_call as _canonical
from opd_trainer.actions import tool_call_function
from opd_trainer.jobspec.dataset import ground_truth_of
from opd_trainer.records import LLMCall
from opd_trainer.rollout.runner import RolloutResult
from opd_trainer.stats import mean

Succeeded = Callable[[RolloutResult], bool | None]


def success_by_threshold(threshold: float) -> Succeeded:
    """Success = the evaluator's score (else the reward) >= `threshold`; None for a failed rollout
    (no score: counted as not succeeded by the callers that need a verdict)."""

    def succeeded(result: RolloutResult) -> bool | None:
        if result.failed:
            return None
        score = result.eval_score if result.eval_score is not None else result.reward
        return score >= threshold

    return succeeded


def message_text(message: dict[str, Any]) -> str:
    """A message's content as text (content parts joined)."""
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content or "")


def is_tool_error(message: dict[str, Any]) -> bool:
    """A tool message that reports an error (this module's docstring says how that is told)."""
    if message.get("status") == "error":
        return True
    text = message_text(message).strip()
    try:
        decoded = json.loads(text)
    except ValueError:
        decoded = None
    if isinstance(decoded, dict) and (decoded.get("error") or decoded.get("is_error")):
        return True
    return text.lower().startswith("error")


def _tool_results(result: RolloutResult) -> dict[str, dict[str, Any]]:
    """The tool messages answering calls this rollout's model made, by call id (a dataset's history may
    hold tool messages of its own: they say nothing of whether this agent runs tools)."""
    made = {call.get("id") for call in _made_calls(result)}
    return {
        m["tool_call_id"]: m
        for m in result.messages
        if m.get("role") == "tool" and m.get("tool_call_id") in made
    }


def _turn_succeeded(call: LLMCall, results: dict[str, dict[str, Any]]) -> bool:
    """`results`: the trajectory's tool messages by call id, empty for an agent that runs no tools."""
    if not call.format_valid:
        return False
    if not results:
        return True
    for tool_call in call.response_message.get("tool_calls") or []:
        answer = results.get(tool_call.get("id", ""))
        if answer is None or is_tool_error(answer):
            return False
    return True


def _cut_off(result: RolloutResult, results: dict[str, dict[str, Any]]) -> bool:
    """An agent that runs tools stopped on a turn whose tool calls never ran."""
    if not results or not result.calls:
        return False
    last = result.calls[-1].response_message.get("tool_calls") or []
    return any(call.get("id") not in results for call in last)


def reference_tool_calls(result: RolloutResult) -> list[dict[str, Any]] | None:
    """The tool calls the sample's reference answer lists, or None when it lists none."""
    reference = ground_truth_of(result.sample)
    if isinstance(reference, str):
        try:
            reference = json.loads(reference)
        except ValueError:
            return None
    calls = reference.get("tool_calls") if isinstance(reference, dict) else None
    return calls if isinstance(calls, list) and all(isinstance(c, dict) for c in calls) else None


def _made_calls(result: RolloutResult) -> list[dict[str, Any]]:
    return [tc for call in result.calls for tc in call.response_message.get("tool_calls") or []]


def agent_metrics(results: list[RolloutResult], succeeded: Succeeded) -> dict[str, float]:
    """The `agent/` metrics of one validation pass (one rollout per sample); see the module docstring."""
    good = [r for r in results if not r.failed]
    turns = [(call, r) for r in good for call in r.calls if call.completion_token_ids]
    results_of = {id(r): _tool_results(r) for r in good}
    metrics = {
        "agent/format_valid_turns": mean([float(call.format_valid) for call, _ in turns]),
        "agent/turn_success": mean([float(_turn_succeeded(call, results_of[id(r)])) for call, r in turns]),
        "agent/task_success": mean([float(bool(succeeded(r))) for r in results]),
        "agent/tool_calls_per_trajectory": mean([float(len(_made_calls(r))) for r in good]),
        "agent/cut_off_share": mean([float(_cut_off(r, results_of[id(r)])) for r in good]),
    }
    metrics.update(_correction_metrics(results, good, results_of, succeeded))
    # A failed rollout made no call the reference asks for: it counts as wrong, not as absent.
    referenced = [(r, calls) for r in results if (calls := reference_tool_calls(r)) is not None]
    if referenced:
        for name, key in (("tool_call_accuracy", _canonical), ("tool_name_accuracy", _name)):
            metrics[f"agent/{name}"] = mean(
                [
                    float(not r.failed and _multiset(_made_calls(r), key) == _multiset(ref, key))
                    for r, ref in referenced
                ]
            )
    return metrics


def _repeats_failing_call(result: RolloutResult, results: dict[str, dict[str, Any]]) -> bool:
    """The agent made a call again (same name and arguments) after that call got an error."""
    failed: set[str] = set()
    for call in result.calls:
        for tool_call in call.response_message.get("tool_calls") or []:
            key = _canonical(tool_call)
            if key in failed:
                return True
            answer = results.get(tool_call.get("id", ""))
            if answer is not None and is_tool_error(answer):
                failed.add(key)
    return False


def _correction_metrics(
    results: list[RolloutResult],
    good: list[RolloutResult],
    results_of: dict[int, dict[str, dict[str, Any]]],
    succeeded: Succeeded,
) -> dict[str, float]:
    """`repeated_failing_call_share`, `recovery_after_error`, `self_correction_success` (module
    docstring), each over a non-empty subset only; a failed rollout counts as not succeeded."""
    metrics: dict[str, float] = {}
    running_tools = [r for r in good if results_of[id(r)]]
    if running_tools:
        repeats = [float(_repeats_failing_call(r, results_of[id(r)])) for r in running_tools]
        metrics["agent/repeated_failing_call_share"] = mean(repeats)
    erred = [r for r in running_tools if any(is_tool_error(m) for m in results_of[id(r)].values())]
    if erred:
        metrics["agent/recovery_after_error"] = mean([float(bool(succeeded(r))) for r in erred])
    wrong_history = [
        r for r in results if any(m.get("role") == "tool" and is_tool_error(m) for m in r.sample.messages)
    ]
    if wrong_history:
        metrics["agent/self_correction_success"] = mean([float(bool(succeeded(r))) for r in wrong_history])
    return metrics


def _name(call: dict[str, Any]) -> str:
    return tool_call_function(call)[0]


def _multiset(calls: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], str]) -> Counter[str]:
    return Counter(key(call) for call in calls)


def pass_at_k(groups: list[list[RolloutResult]], succeeded: Succeeded) -> float:
    """Share of prompts (one list of k rollouts each) where at least one rollout succeeded."""
    return mean([float(any(bool(succeeded(r)) for r in group)) for group in groups])
