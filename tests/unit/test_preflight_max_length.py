"""`hyper_parameters.max_length`: the models' context by default, refused beyond it before engines start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.preflight import model_context_length, resolve_max_length


def _model(folder: Path, **config: object) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_default_is_the_smaller_context(tmp_path: Path) -> None:
    student = _model(tmp_path / "s", max_position_embeddings=4096)
    teacher = _model(tmp_path / "t", max_position_embeddings=1024)
    assert resolve_max_length(None, {"model": student, "teacher_model": teacher}) == 1024
    assert resolve_max_length(512, {"model": student, "teacher_model": teacher}) == 512


def test_beyond_the_context_names_the_field_and_the_model(tmp_path: Path) -> None:
    student = _model(tmp_path / "s", max_position_embeddings=1024)
    teacher = _model(tmp_path / "t", max_position_embeddings=32768)
    with pytest.raises(ConfigError) as raised:
        resolve_max_length(2048, {"model": student, "teacher_model": teacher})
    assert raised.value.field == "hyper_parameters.max_length"
    assert "student's context of 1024" in raised.value.message


def test_other_config_layouts(tmp_path: Path) -> None:
    assert model_context_length(_model(tmp_path / "gpt2", n_positions=1024), "model") == 1024
    nested = _model(tmp_path / "vlm", text_config={"max_position_embeddings": 8192})
    assert model_context_length(nested, "model") == 8192
    assert model_context_length(str(tmp_path / "missing"), "model") is None


def test_no_stated_context_needs_an_explicit_length(tmp_path: Path) -> None:
    student, teacher = _model(tmp_path / "s"), _model(tmp_path / "t")
    assert resolve_max_length(777, {"model": student, "teacher_model": teacher}) == 777
    with pytest.raises(ConfigError) as raised:
        resolve_max_length(None, {"model": student, "teacher_model": teacher})
    assert raised.value.field == "hyper_parameters.max_length"


def test_every_teacher_bounds_the_length_and_is_named(tmp_path: Path) -> None:
    sources = {
        "model": _model(tmp_path / "s", max_position_embeddings=4096),
        "teacher_model.0.model": _model(tmp_path / "t0", max_position_embeddings=2048),
        "teacher_model.1.model": _model(tmp_path / "t1", max_position_embeddings=1024),
    }
    assert resolve_max_length(None, sources) == 1024
    with pytest.raises(ConfigError) as raised:
        resolve_max_length(1500, sources)
    assert "teacher (teacher_model.1.model)'s context of 1024" in raised.value.message
