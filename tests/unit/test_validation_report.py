"""Validation aggregates and reports that assume no task: any metric names, any failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from opd_trainer.cli.train import format_final_table
from opd_trainer.driver.plots import plot_curves, signal_panels, validation_curve_keys
from opd_trainer.jobspec.dataset import Sample
from opd_trainer.records import LLMCall
from opd_trainer.rollout.runner import RolloutResult, reward_failures, validation_metrics


def _result(index: int, **fields: object) -> RolloutResult:
    extra = {"sample_id": f"v{index}"}
    sample = Sample("v.jsonl", index + 1, [{"role": "user", "content": "q"}], None, extra)
    call = LLMCall(
        [1, 2], [3], [-0.5], 0, "stop", response_message={"role": "assistant", "content": "a"}, latency_s=0.01
    )
    result = RolloutResult(index, index, f"r{index}", sample, calls=[call])
    for name, value in fields.items():
        setattr(result, name, value)
    return result


def test_a_sample_that_failed_or_went_unscored_counts_as_wrong() -> None:
    results = [
        _result(0, reward=1.0, component_rewards={"r": 1.0}, eval_score=1.0, eval_metrics={"accuracy": 1.0}),
        _result(1, reward=0.0, component_rewards={"r": 0.0}, eval_error="evaluator e failed: KeyError"),
        _result(2, error="reward r failed: TypeError", eval_score=1.0, eval_metrics={"accuracy": 1.0}),
        _result(3, calls=[]),  # the rollout itself produced nothing
        _result(4, reward=1.0, component_rewards={"r": 1.0}, eval_score=0.5, eval_metrics={"accuracy": 0.5}),
    ]
    metrics = validation_metrics(results, has_rewards=True, has_evaluator=True)
    assert metrics["samples"] == 5 and metrics["failed_samples"] == 3 and metrics["scored_samples"] == 2
    # Rewards: means over what the reward workers scored (their scale is the user's).
    assert metrics["reward_mean"] == pytest.approx(2 / 3) and metrics["reward/r"] == pytest.approx(2 / 3)
    # The evaluator's numbers: over all five, the three it could not score (or whose rollout failed,
    # even with a score) as 0.
    assert metrics["eval_score"] == pytest.approx(1.5 / 5) and metrics["accuracy"] == pytest.approx(1.5 / 5)
    failures = {f["sample_id"]: f["error"] for f in reward_failures(results)}
    assert set(failures) == {"v1", "v2", "v3"}
    assert "KeyError" in failures["v1"] and "TypeError" in failures["v2"]
    assert failures["v3"] == "no completion recorded"


def test_an_evaluator_that_scored_nothing_reports_zero_not_nothing() -> None:
    metrics = validation_metrics([_result(0, calls=[]), _result(1, calls=[])], False, has_evaluator=True)
    assert metrics["eval_score"] == 0.0 and metrics["scored_samples"] == 0.0
    assert metrics["failed_samples"] == 2


def test_without_rewards_or_evaluator_only_counts() -> None:
    assert validation_metrics([_result(0)], has_rewards=False) == {"samples": 1.0, "failed_samples": 0.0}


def test_final_table_has_a_column_per_reported_metric() -> None:
    summary = {
        "teacher": {"samples": 4.0, "bleu": 0.9, "reverse_kl": 0.0},
        "student_before": {"samples": 4.0, "bleu": 0.25, "reward_mean": 0.1, "reverse_kl": 0.75},
        "student_after": {"samples": 4.0, "bleu": 0.5, "reward_mean": 0.4, "reverse_kl": 0.2},
    }
    lines = format_final_table(summary).splitlines()
    assert lines[0].split() == ["bleu", "reverse_kl", "reward_mean"]
    assert lines[2].split() == ["teacher", "0.900", "0.000", "—"]
    assert lines[4].split() == ["student", "after", "0.500", "0.200", "0.400"]


def test_validation_curves_follow_the_records(tmp_path: Path) -> None:
    evals = [{"kind": "eval", "step": 0, "samples": 4.0, "reverse_kl": 0.7, "reward_mean": 0.1, "f1": 0.2}]
    assert validation_curve_keys(evals) == ["f1"]
    without_evaluator = [{k: v for k, v in e.items() if k != "f1"} for e in evals]
    assert validation_curve_keys(without_evaluator) == ["reward_mean"]
    train = [{"kind": "train", "step": 1, "reverse_kl": 0.6}]
    out = plot_curves([*train, *evals], tmp_path / "curves.png")
    assert out.stat().st_size > 0


def test_signal_diagnostics_get_panels_when_logged(tmp_path: Path) -> None:
    sampled = [{"kind": "train", "step": 1, "reverse_kl": 0.6, "signal_std": 0.9}]
    assert [name for name, _ in signal_panels(sampled)] == ["per-token signal std"]
    top_k = [{**sampled[0], "teacher_topk_mass": 0.97, "student_topk_mass": 0.6}]
    panels = signal_panels(top_k)
    assert [name for name, _ in panels] == ["mass on the teacher's top-k", "per-token signal std"]
    assert [key for _, _, key in panels[0][1]] == ["teacher_topk_mass", "student_topk_mass"]
    assert signal_panels([{"kind": "train", "step": 1, "reverse_kl": 0.6}]) == []
    assert plot_curves(top_k, tmp_path / "curves.png").stat().st_size > 0
