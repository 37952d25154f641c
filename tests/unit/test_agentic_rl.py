"""Bailian's submission classes build the job document the spec accepts; `run` answers like Bailian's."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from opd_trainer.client.agentic_rl import (
    AgenticRL,
    DataSourceType,
    FunctionComponentModel,
    FunctionComponentRuntime,
    RewardFunctionComponent,
    RolloutFunctionComponent,
    TrainingDataset,
    ValidationDataset,
    _plain,
)
from opd_trainer.jobspec.job_spec import parse_job_spec

RUNTIME = {"cpu": 2, "memory_size": 4096, "disk_size": 512, "concurrency": 20}


def test_bailian_objects_make_a_valid_job_document() -> None:
    functions = [
        RolloutFunctionComponent(
            name="my-rollout",
            timeout=120,
            fcmodel=FunctionComponentModel(zipdir=".", classpath="functions.rollout.my_rollout.MyRollout"),
            runtime=FunctionComponentRuntime(**RUNTIME, capacity=10, min_capacity=10, max_capacity=30),
        ),
        RewardFunctionComponent(
            name="my-reward",
            weight=0.5,
            timeout=120,
            fcmodel=FunctionComponentModel(zipdir=".", classpath="functions.reward.my_reward.MyReward"),
        ),
    ]
    document = {
        "job_name": "j",
        "model": "m",
        "teacher_model": "t",
        "training_datasets": [
            _plain(TrainingDataset(data_source_type=DataSourceType.FILE_ID, file_name="data/train.jsonl"))
        ],
        "validation_datasets": [_plain(ValidationDataset(file_name="file-abc"))],
        "functions": [_plain(f) for f in functions],
    }
    spec = parse_job_spec(document)
    assert spec.training_datasets == ["data/train.jsonl"] and spec.validation_datasets == ["file-abc"]
    assert [(f.type, f.name, f.weight) for f in spec.functions] == [
        ("rollout", "my-rollout", 1.0),
        ("reward", "my-reward", 0.5),
    ]
    assert spec.functions[0].runtime.capacity == 10 and spec.functions[0].fcmodel.zipdir == "."
    assert DataSourceType.FILE_ID == "FILE_ID"


def test_component_kinds_are_fixed_and_fields_checked() -> None:
    fcmodel = FunctionComponentModel(zipdir=".", classpath="a.B")
    with pytest.raises(ValidationError, match="type"):
        RolloutFunctionComponent(name="r", type="reward", fcmodel=fcmodel)
    with pytest.raises(ValidationError, match="min_capacity"):
        FunctionComponentRuntime(capacity=1, min_capacity=3)
    with pytest.raises(ValidationError, match="zipdir"):
        FunctionComponentModel(classpath="a.B")


def test_a_problem_found_locally_is_a_400_result_not_an_exception() -> None:
    # Nothing is sent: the dataset path does not exist, so no server is needed (the address is closed).
    client = AgenticRL(base_url="http://127.0.0.1:9", api_key="k")
    result = asyncio.run(
        client.run(
            job_name="j",
            model="m",
            teacher_model="t",
            training_datasets=[TrainingDataset(file_name="no/such/train.jsonl")],
        )
    )
    assert result.status_code == 400 and result.output.job_id is None
    assert result.param == "training_datasets.0" and "neither a local file nor a file id" in result.message
