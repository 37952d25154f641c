"""Promotion (`driver/promotion.py`, `storage/checkpoints.py`): which validation wins, the gates, the
decision a finished job records, retention that never removes the best, and the spec's defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from opd_trainer.driver.promotion import Promoter
from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.storage.checkpoints import CheckpointStore
from opd_trainer.storage.run_dir import RunDir
from opd_trainer.wire.checkpoint import CheckpointState, CursorState, PromotionDecision


def _spec(**fields: Any) -> Any:
    base = {"job_name": "j", "model": "s", "teacher_model": "t", "training_datasets": ["t.jsonl"]}
    return parse_job_spec({**base, **fields})


def _promoter(**promotion: Any) -> Promoter:
    promoter = Promoter.for_job(_spec(validation_datasets=["v.jsonl"], promotion=promotion))
    assert promoter is not None
    return promoter


def test_the_best_validation_wins_in_the_metrics_direction() -> None:
    higher = _promoter(metric="exact_match")
    higher.observe_start({"exact_match": 0.2})
    assert [higher.consider(s, {"exact_match": v}) for s, v in [(10, 0.5), (20, 0.9), (30, 0.8)]] == [
        True,
        True,
        False,
    ]
    assert (higher.best_step, higher.best_value) == (20, 0.9)
    lower = _promoter()  # no evaluator, no rewards: reverse_kl, lower is better
    assert (lower.metric, lower.higher_is_better) == ("reverse_kl", False)
    assert [lower.consider(s, {"reverse_kl": v}) for s, v in [(1, 0.5), (2, 0.3), (3, 0.4)]] == [
        True,
        True,
        False,
    ]
    assert lower.decision("step-000002", final=True).reason == "best reverse_kl 0.3 at step 2"


def test_a_gate_no_validation_meets_leaves_no_model_and_says_why() -> None:
    gated = _promoter(metric="exact_match", min_gain_over_start=0.5)
    gated.observe_start({"exact_match": 0.3})
    assert not gated.consider(5, {"exact_match": 0.7})  # needs 0.8
    assert gated.consider(10, {"exact_match": 0.85})
    strict = _promoter(metric="exact_match", threshold=0.95)
    strict.observe_start({"exact_match": 0.3})
    assert not any(strict.consider(s, {"exact_match": v}) for s, v in [(1, 0.5), (2, 0.9), (3, 0.6)])
    decision = strict.decision(None, final=True)
    assert decision.checkpoint is None and decision.step is None
    assert decision.reason == (
        "no validation met the gate; the best, at step 2: exact_match 0.9 does not reach the threshold 0.95"
    )


def test_a_metric_validation_does_not_report_fails_naming_the_ones_it_does() -> None:
    promoter = _promoter(metric="exact_match")
    with pytest.raises(ConfigError, match="reports: bleu, reverse_kl") as caught:
        promoter.observe_start({"bleu": 0.1, "reverse_kl": 0.5})
    assert caught.value.field == "promotion.metric"


def test_a_resumed_job_keeps_its_best() -> None:
    before = _promoter(metric="exact_match")
    before.observe_start({"exact_match": 0.1})
    before.consider(10, {"exact_match": 0.7})
    after = _promoter(metric="exact_match")
    after.restore(before.state())
    assert not after.consider(20, {"exact_match": 0.6}) and after.best_step == 10 and after.start == 0.1


def test_defaults_and_refusals_of_the_spec() -> None:
    with_evaluator = _spec(
        validation_datasets=["v.jsonl"],
        functions=[{"name": "e", "type": "evaluator", "fcmodel": {"zipdir": "w", "classpath": "m.C"}}],
    )
    assert with_evaluator.promotion_metric == "eval_score"
    assert with_evaluator.promotion.direction_higher("eval_score")
    assert not with_evaluator.promotion.direction_higher("val_loss")
    assert Promoter.for_job(_spec()) is None  # no validation: the model is the last checkpoint
    with pytest.raises(ConfigError, match="promotion chooses a checkpoint by validation"):
        _spec(promotion={"metric": "exact_match"})


def _decision(checkpoint: str | None, *, final: bool) -> PromotionDecision:
    reason = "best exact_match 0.9 at step 20" if checkpoint else "no validation met the gate"
    return PromotionDecision(
        checkpoint=checkpoint,
        metric="exact_match",
        higher_is_better=True,
        start=0.2,
        step=20 if checkpoint else None,
        value=0.9 if checkpoint else None,
        final=final,
        reason=reason,
    )


def _checkpoint(store: CheckpointStore, step: int) -> None:
    staging = store.staging(step)
    (staging / "student").mkdir()
    store.commit(staging, CheckpointState(step=step, cursor=CursorState(epoch=0, position=0), total_steps=40))


def test_retention_keeps_the_newest_the_latest_and_the_promoted(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    for step in (10, 20, 30, 40):
        _checkpoint(store, step)
    run = RunDir(tmp_path)
    assert run.promoted() is None and run.fine_tuned_model_id() == "step-000040"  # no promotion: latest
    store.promote(_decision("step-000020", final=False))
    assert store.prune(1) == ["step-000010", "step-000030"]
    assert [c["id"] for c in store.list()] == ["step-000020", "step-000040"]
    assert run.fine_tuned_model_id() == "step-000020"
    store.promote(_decision(None, final=True))
    assert run.fine_tuned_model_id() is None
