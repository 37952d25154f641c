"""Several teachers: the list form of `teacher_model`, routing by data tag, and scoring each pair on
its own teacher's engines (engine groups faked here; tests/integration/test_multi_teacher.py runs them)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from opd_trainer.driver.step import per_teacher_metrics
from opd_trainer.driver.teachers import TeacherEngines
from opd_trainer.engine.vllm_engine import TeacherScores
from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.dataset import Sample, data_tag_of
from opd_trainer.jobspec.job_spec import parse_job_spec, resolve_paths
from opd_trainer.records import LLMCall

BASE = {"job_name": "j", "model": "/models/student", "training_datasets": ["math.jsonl", "chat.jsonl"]}
TWO = [
    {"name": "math", "model": "/models/math", "data_tags": ["math", "algebra"]},
    {"name": "general", "model": "self"},
]


def test_one_teacher_is_the_teacher_named_teacher() -> None:
    spec = parse_job_spec({**BASE, "teacher_model": "/models/t"})
    assert [(t.name, t.model, t.data_tags) for t in spec.teachers] == [("teacher", "/models/t", [])]
    assert spec.weight_sources() == {"model": "/models/student", "teacher_model": "/models/t"}
    assert spec.teacher_for_tag("anything") == "teacher"


def test_the_list_form_routes_by_tag_with_a_default() -> None:
    spec = parse_job_spec({**BASE, "teacher_model": TWO})
    # The teacher without tags is the default (listed first), `self` is the student's model.
    assert [(t.name, t.model) for t in spec.teachers] == [
        ("general", "/models/student"),
        ("math", "/models/math"),
    ]
    assert spec.default_teacher_model == "/models/student"
    assert spec.teacher_for_tag("algebra") == "math"
    assert spec.teacher_for_tag("chat") == "general"
    assert spec.weight_sources() == {
        "model": "/models/student",
        "teacher_model.0.model": "/models/math",
        "teacher_model.1.model": "/models/student",
    }
    # What the server stores parses back to the same spec.
    assert parse_job_spec(spec.model_dump(mode="json")) == spec


def test_without_an_untagged_teacher_the_first_is_the_default() -> None:
    tagged = [
        {"name": "a", "model": "/a", "data_tags": ["x"]},
        {"name": "b", "model": "/b", "data_tags": ["y"]},
    ]
    spec = parse_job_spec({**BASE, "teacher_model": tagged})
    assert spec.teacher_for_tag("y") == "b"
    assert spec.teacher_for_tag("unknown") == "a"


def test_weight_sources_are_replaced_in_place(tmp_path: Path) -> None:
    (tmp_path / "math").mkdir()
    spec = parse_job_spec({**BASE, "teacher_model": [{"name": "m", "model": "math"}]})
    resolved = resolve_paths(spec, tmp_path)
    assert resolved.weight_sources()["teacher_model.0.model"] == str((tmp_path / "math").resolve())
    renamed = spec.with_weight_sources({"teacher_model.0.model": "/elsewhere"})
    assert renamed.teachers[0].model == "/elsewhere" and renamed.teachers[0].name == "m"


@pytest.mark.parametrize(
    ("teacher_model", "field", "says"),
    [
        ([], "teacher_model", "at least 1"),
        (5, "teacher_model", "valid string"),
        ([{"name": "bad name", "model": "/m"}], "teacher_model.0.name", "pattern"),
        ([{"name": "a"}], "teacher_model.0.model", "required"),
        ([{"name": "a", "model": "/m", "extra": 1}], "teacher_model.0.extra", "not permitted"),
        (
            [{"name": "a", "model": "/m", "data_tags": ["x", "x"]}],
            "teacher_model.0.data_tags",
            "more than once",
        ),
        (
            [{"name": "a", "model": "/m"}, {"name": "a", "model": "/n", "data_tags": ["x"]}],
            "teacher_model",
            "unique",
        ),
        ([{"name": "a", "model": "/m"}, {"name": "b", "model": "/n"}], "teacher_model", "no data_tags"),
        (
            [
                {"name": "a", "model": "/m", "data_tags": ["x"]},
                {"name": "b", "model": "/n", "data_tags": ["x"]},
            ],
            "teacher_model",
            "more than one teacher",
        ),
    ],
)
def test_bad_teacher_lists_name_the_field(teacher_model: Any, field: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as raised:
        parse_job_spec({**BASE, "teacher_model": teacher_model})
    assert raised.value.field == field


def _sample(source: str, **extra: Any) -> Sample:
    return Sample(
        source=source, line=1, messages=[{"role": "user", "content": "q"}], tools=None, rollout_extra=extra
    )


def test_a_samples_tag_is_its_own_else_its_datasets() -> None:
    assert data_tag_of(_sample("/data/math.jsonl")) == "math"
    assert data_tag_of(_sample("/data/math.jsonl", data_tag="chat")) == "chat"
    assert data_tag_of(_sample("/data/file-abc123", data_tag=7)) == "file-abc123"  # not a string: the file's


class _Group:
    """An engine group that answers with its own marker, so each pair shows who scored it."""

    def __init__(self, marker: float, delay: float = 0.0) -> None:
        self.marker, self.delay, self.calls = marker, delay, 0

    async def score_top_k_many(
        self, pairs: list[tuple[list[int], list[int]]], top_k: int
    ) -> list[TeacherScores]:
        self.calls += 1
        await asyncio.sleep(self.delay)
        return [
            TeacherScores(np.full(len(c), self.marker), np.zeros((len(c), top_k)), np.zeros((len(c), top_k)))
            for _, c in pairs
        ]

    async def score_many(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        return [[self.marker] * len(c) for _, c in pairs]

    async def stats(self) -> dict[str, float]:
        return {"prompt_tokens": self.marker, "kv_cache_usage_max": self.marker / 10}

    async def usage(self) -> dict[str, float]:
        return {"prompt_tokens": self.marker, "cpu_s": 1.0}


def test_each_pair_is_scored_by_its_teacher_in_input_order() -> None:
    spec = parse_job_spec({**BASE, "teacher_model": TWO})
    math, general = _Group(-1.0, delay=0.05), _Group(-2.0)
    teachers = TeacherEngines(spec, {"math": math, "general": general})  # type: ignore[dict-item]
    samples = [_sample("/d/math.jsonl"), _sample("/d/chat.jsonl"), _sample("/d/x.jsonl", data_tag="algebra")]
    names = [teachers.name_for(s) for s in samples]
    assert names == ["math", "general", "math"]
    pairs = [([1], [2, 3]), ([1], [4]), ([5], [6, 7, 8])]
    scored = asyncio.run(teachers.score_top_k(names, pairs, 2))
    assert [s.teacher for s in scored] == names
    assert [s.scores.logprobs.tolist() for s in scored] == [[-1.0, -1.0], [-2.0], [-1.0, -1.0, -1.0]]
    assert (math.calls, general.calls) == (1, 1)  # one request per teacher, in parallel
    assert scored[0].latency_s >= 0.05 > scored[1].latency_s
    assert asyncio.run(teachers.score(names, pairs)) == [[-1.0, -1.0], [-2.0], [-1.0, -1.0, -1.0]]
    roles = asyncio.run(teachers.stats())
    assert roles["teacher"]["prompt_tokens"] == -3.0 and roles["teacher.math"]["prompt_tokens"] == -1.0
    assert asyncio.run(teachers.usage()) == {"prompt_tokens": -3.0, "cpu_s": 2.0}
    assert teachers.default is general


def test_one_teacher_reports_one_role_and_routes_everything_to_it() -> None:
    spec = parse_job_spec({**BASE, "teacher_model": "/models/t"})
    teachers = TeacherEngines(spec, {"teacher": _Group(-1.0)})  # type: ignore[dict-item]
    assert not teachers.several and teachers.name_for(_sample("/d/math.jsonl", data_tag="x")) == "teacher"
    assert set(asyncio.run(teachers.stats())) == {"teacher"}


def test_per_teacher_metrics_split_the_steps_segments() -> None:
    def segment(teacher: str, sampler: float, scored: float, latency: float) -> LLMCall:
        return LLMCall(
            prompt_token_ids=[1, 2],
            completion_token_ids=[3, 4],
            sampler_logprobs=[sampler, sampler],
            teacher_logprobs=[scored, scored],
            teacher_name=teacher,
            teacher_latency_s=latency,
        )

    metrics = per_teacher_metrics(
        [segment("a", -1.0, -1.0, 0.2), segment("b", -1.0, -3.0, 0.4), segment("a", -1, -1, 0.4)]
    )
    assert metrics["teacher/a/segments"] == 2.0 and metrics["teacher/b/segments"] == 1.0
    assert metrics["teacher/a/scored_tokens"] == 8.0
    assert metrics["teacher/a/reverse_kl"] == pytest.approx(0.0)
    assert metrics["teacher/b/reverse_kl"] == pytest.approx(2.0)
    assert metrics["teacher/a/latency_s"] == pytest.approx(0.3)
