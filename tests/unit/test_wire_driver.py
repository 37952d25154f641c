"""The driver's reports as typed models (`wire/driver.py`): they read what earlier drivers wrote and
write it byte for byte, cross Ray (pickle), and a bad value fails naming its field."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest
from pydantic import ValidationError

from opd_trainer.driver.recovery import RecoveryLog
from opd_trainer.storage.run_dir import RunDir
from opd_trainer.wire.driver import DriverEvent, DriverProgress, RecoveryRecord, driver_events

# `progress()` as the scheduler has always read it.
PROGRESS = {
    "status": "running",
    "step": 3,
    "total_steps": 10,
    "metrics": {"reverse_kl": 0.25, "tokens_per_s": 812.5, "pool/judge/workers": 2.0},
    "eta_s": 41.0,
    "usage": {"teacher_tokens": 1200.0, "wall_s": 30.5},
}
# Lines of an events.jsonl as drivers have written them.
EVENT_LINES = [
    {"seq": 0, "time": 1700000000.5, "type": "status", "message": "starting engines and learner", "data": {}},
    {
        "seq": 1,
        "time": 1700000010.25,
        "type": "step",
        "message": "step 1/10 reverse_kl=0.2500 tokens/s=812",
        "data": {"step": 1, "total_steps": 10, "reverse_kl": 0.25, "loss": 0.5, "tokens_per_s": 812.5},
    },
    {
        "seq": 2,
        "time": 1700000011.0,
        "type": "eval_outcomes",
        "message": "student before: 1 of 2 samples succeeded",
        "data": {"label": "student before", "outcomes": [{"sample_id": "a", "succeeded": True}]},
    },
    {"seq": 3, "time": 1700000012.0, "type": "error", "message": "run_dir: no", "data": {"field": "run_dir"}},
]


def test_progress_round_trips_the_dict_the_scheduler_read() -> None:
    progress = DriverProgress.model_validate(PROGRESS)
    assert progress.model_dump() == PROGRESS
    assert pickle.loads(pickle.dumps(progress)) == progress  # crosses Ray from the driver


def test_a_bad_progress_value_names_its_field() -> None:
    with pytest.raises(ValidationError) as caught:
        DriverProgress.model_validate({**PROGRESS, "step": "three"})
    assert [error["loc"] for error in caught.value.errors()] == [("step",)]
    with pytest.raises(ValidationError) as caught:
        DriverProgress.model_validate({**PROGRESS, "metrics": ["reverse_kl"]})
    assert [error["loc"] for error in caught.value.errors()] == [("metrics",)]
    with pytest.raises(ValidationError) as caught:
        DriverProgress.model_validate({**PROGRESS, "status": "paused"})  # a server status, not a driver's
    assert [error["loc"] for error in caught.value.errors()] == [("status",)]


def test_a_progress_keeps_only_the_metrics_that_are_numbers() -> None:
    """What the scheduler always kept: a step or pool reporting a metric as text or None costs that
    metric, not the driver's answer."""
    odd = {
        "phase": "scoring",
        "reverse_kl": 0.25,
        "lr": None,
        "tokens": 812,
        "nested": {"a": 1.0},
        "ok": True,
    }
    progress = DriverProgress.model_validate({**PROGRESS, "metrics": odd, "usage": None})
    assert progress.metrics == {"reverse_kl": 0.25, "tokens": 812.0, "ok": 1.0}
    assert progress.usage == {}


def test_events_read_back_and_are_written_as_before(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.events_path.write_text("".join(json.dumps(line) + "\n" for line in EVENT_LINES))
    events = run.events()
    assert [event.model_dump() for event in events] == EVENT_LINES
    assert run.validation_outcomes() == [
        {"label": "student before", "time": 1700000011.0, "outcomes": EVENT_LINES[2]["data"]["outcomes"]}
    ]
    written = RunDir(tmp_path / "again")
    written.root.mkdir()
    for event in events:
        written.event(event)
    assert written.events_path.read_bytes() == run.events_path.read_bytes()
    assert pickle.loads(pickle.dumps(events)) == events


def test_an_event_of_a_kind_this_build_does_not_emit_passes_through() -> None:
    """A driver of another build may emit kinds this one does not: shown as they were written."""
    event = DriverEvent.model_validate({**EVENT_LINES[0], "type": "rollout_stats", "extra": 1})
    assert event.type == "rollout_stats" and event.model_dump() == {**EVENT_LINES[0], "type": "rollout_stats"}


def test_a_bad_event_value_names_its_field() -> None:
    with pytest.raises(ValidationError) as caught:
        DriverEvent.model_validate({**EVENT_LINES[0], "seq": "first"})
    assert [error["loc"] for error in caught.value.errors()] == [("seq",)]


def test_reading_events_skips_what_is_no_event_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """events.jsonl with a kind this build does not emit, a line that is no event and a last line
    half written: the events are read, the rest skipped with one warning; counting parses nothing."""
    run = RunDir(tmp_path)
    unknown = {**EVENT_LINES[1], "type": "rollout_stats"}
    lines = [
        json.dumps(EVENT_LINES[0]),
        json.dumps(unknown),
        json.dumps({"seq": 2}),
        json.dumps(EVENT_LINES[3]),
    ]
    run.events_path.write_text("\n".join(lines) + "\n" + json.dumps(EVENT_LINES[2])[:40])
    with caplog.at_level(logging.WARNING, logger="opd_trainer.wire.driver"):
        events = run.events()
    assert [event.model_dump() for event in events] == [EVENT_LINES[0], unknown, EVENT_LINES[3]]
    [warning] = caplog.records
    assert "skipped 1 record(s)" in warning.getMessage() and str(run.events_path) in warning.getMessage()
    # The half-written line is not a whole one: the next driver's first event starts on it.
    assert run.event_count() == 4
    assert [event.seq for event in run.events(run.event_count() - 1)] == [3]
    assert RunDir(tmp_path / "none").event_count() == 0 and RunDir(tmp_path / "none").events() == []


def test_events_a_driver_of_an_earlier_build_returns_are_read_as_events() -> None:
    """Over Ray such a driver answers with the dicts it wrote; this build's answer with its models."""
    mixed = [EVENT_LINES[0], DriverEvent.model_validate(EVENT_LINES[1]), "no event"]
    assert [event.seq for event in driver_events(mixed, "test")] == [0, 1]


def test_recoveries_read_back_and_are_written_as_before(tmp_path: Path) -> None:
    line = {"time": 1700000000.0, "step": 3, "cause": "learner rank 0", "message": "lost", "resumes_from": 2}
    (tmp_path / "recoveries.jsonl").write_text(json.dumps(line) + "\n")
    [entry] = RecoveryLog(tmp_path).entries()
    assert entry == RecoveryRecord(**line)
    assert json.dumps(entry.model_dump()) == json.dumps(line)
    with (tmp_path / "recoveries.jsonl").open("a") as out:  # a newer build's line, with a key more
        out.write(json.dumps({**line, "step": 5, "node": "n1"}) + "\n")
    assert [entry.step for entry in RecoveryLog(tmp_path).entries()] == [3, 5]
