"""A checkpoint's driver state and the promotion decision as typed models (`wire/checkpoint.py`):
what earlier drivers wrote still loads, and a commit writes the same bytes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from opd_trainer.driver.promotion import Promoter
from opd_trainer.storage.checkpoints import STATE_FILE, CheckpointStore
from opd_trainer.storage.run_dir import RunDir
from opd_trainer.wire.checkpoint import CheckpointState, PromotionDecision

# driver_state.json as the driver has written it (`json.dumps(state, indent=2)`).
STATE = {
    "step": 4,
    "cursor": {"epoch": 1, "position": 3},
    "total_steps": 8,
    "promotion": {
        "metric": "exact_match",
        "higher_is_better": True,
        "min_gain_over_start": None,
        "threshold": 0.5,
        "start": 0.2,
        "best_step": 4,
        "best_value": 0.75,
        "top_step": 4,
        "top_value": 0.75,
    },
}
DECISION = {
    "checkpoint": "step-000004",
    "metric": "exact_match",
    "higher_is_better": True,
    "start": 0.2,
    "step": 4,
    "value": 0.75,
    "final": False,
    "reason": "best exact_match 0.75 at step 4",
}


def _written(store: CheckpointStore, step: int, text: str) -> Path:
    """A checkpoint committed by an earlier driver: its folder, its state file and `latest`."""
    folder = store.root / store.name(step)
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text(text)
    (store.root / "latest").write_text(folder.name)
    return folder


def test_a_checkpoint_an_earlier_driver_wrote_loads_and_commits_the_same_bytes(tmp_path: Path) -> None:
    old = CheckpointStore(tmp_path / "old")
    text = json.dumps(STATE, indent=2)
    _written(old, 4, text)
    latest = old.latest()
    assert latest is not None
    state = latest[1]
    assert state.model_dump() == STATE and old.latest_step() == 4
    new = CheckpointStore(tmp_path / "new")
    committed = new.commit(new.staging(4), state)
    assert (committed / STATE_FILE).read_text() == text


def test_a_checkpoint_from_before_promotion_loads_without_it(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _written(store, 2, json.dumps({"step": 2, "cursor": {"epoch": 0, "position": 8}, "total_steps": 4}))
    latest = store.latest()
    assert latest is not None and latest[1].promotion is None and latest[1].cursor.position == 8


def test_files_a_newer_build_wrote_with_more_keys_load(tmp_path: Path) -> None:
    """A key this build does not know (a newer driver's) is ignored, so a downgrade still resumes."""
    store = CheckpointStore(tmp_path / "checkpoints")
    _written(store, 4, json.dumps({**STATE, "sampler_seed": 7, "cursor": {**STATE["cursor"], "shard": 2}}))
    latest = store.latest()
    assert latest is not None and latest[1].model_dump() == STATE
    assert [checkpoint["step"] for checkpoint in store.list()] == [4]
    (store.root / "promoted.json").write_text(json.dumps({**DECISION, "gate": "threshold"}))
    promoted = RunDir(tmp_path).promoted()
    assert promoted is not None and promoted.model_dump() == DECISION


def test_a_bad_state_names_its_field() -> None:
    with pytest.raises(ValidationError) as caught:
        CheckpointState.model_validate({**STATE, "cursor": {"epoch": 0}})
    assert [error["loc"] for error in caught.value.errors()] == [("cursor", "position")]


def test_a_not_finite_start_survives_the_json() -> None:
    state = CheckpointState.model_validate({**STATE, "promotion": {**STATE["promotion"], "start": math.nan}})
    read = CheckpointState.model_validate_json(json.dumps(state.model_dump()))
    assert (
        read.promotion is not None and read.promotion.start is not None and math.isnan(read.promotion.start)
    )


def test_the_promotion_decision_reads_back_and_is_written_as_before(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    decision = PromotionDecision.model_validate(DECISION)
    store.promote(decision)
    assert (store.root / "promoted.json").read_text() == json.dumps(DECISION, indent=2)
    run = RunDir(tmp_path)
    assert run.promoted() == decision
    (store.root / "promoted.json").write_text("{half")  # caught mid-write: no decision yet
    assert run.promoted() is None


def test_the_promoters_state_round_trips_through_a_checkpoint() -> None:
    state = CheckpointState.model_validate(STATE)
    promoter = Promoter("exact_match", True, None, 0.5)
    promoter.restore(state.promotion)
    assert promoter.state() == state.promotion
    assert promoter.decision("step-000004", final=False).model_dump() == DECISION
