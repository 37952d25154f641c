"""A job part Ray cannot place fails within `resources.placement_timeout_s`, naming the field that
sized the request and what the cluster has, instead of waiting for a node that never comes."""

from __future__ import annotations

import asyncio

import pytest
from test_learner_ranks import _settings

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import tiny_engine_config
from opd_trainer.engine.vllm_engine import EngineGroup
from opd_trainer.errors import ConfigError
from opd_trainer.learner.deepspeed_learner import LearnerGroup

pytestmark = pytest.mark.integration


def test_engines_that_cannot_be_placed_fail_naming_their_resources(
    ray_session: None, tiny_models: TinyModels
) -> None:
    config = tiny_engine_config(tiny_models.teacher).model_copy(
        update={"num_cpus": 4096.0, "role": "teacher", "placement_timeout_s": 3.0}
    )
    with pytest.raises(ConfigError) as error:
        asyncio.run(EngineGroup.start(config, "unplaceable"))
    assert error.value.field == "resources.teacher"
    assert "4096 CPU" in error.value.message and "CPU free" in error.value.message


def test_learner_ranks_that_cannot_be_placed_fail_naming_learner_gpus(
    ray_session: None, tiny_models: TinyModels
) -> None:
    group = LearnerGroup(_settings(tiny_models, 2), 2, 64.0, placement_timeout_s=3.0)
    with pytest.raises(ConfigError) as error:
        asyncio.run(group.initialize())
    assert error.value.field == "resources.learner_gpus"
    assert "2 learner rank(s)" in error.value.message and "64 GPU" in error.value.message
