"""A job part Ray cannot place fails within `resources.placement_timeout_s`, naming the field that
sized the request and what the cluster has, instead of waiting for a node that never comes."""

from __future__ import annotations

import asyncio

import pytest
from test_learner_ranks import _settings

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import tiny_engine_config
from opd_trainer.engine.fleet import start_replicas
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
        asyncio.run(start_replicas(config, "unplaceable"))
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


def test_learner_ranks_are_reserved_all_at_once_or_not_at_all(
    ray_session: None, tiny_models: TinyModels
) -> None:
    """More ranks than the node has CPU slots: without a placement group Ray would start the ranks
    that fit and leave them waiting for the rest (holding CPUs another job needs); the gang starts none."""
    import ray
    from ray.util.placement_group import placement_group_table

    ranks = int(ray.cluster_resources()["CPU"]) + 1
    free_before = ray.available_resources().get("CPU", 0.0)
    assert free_before >= 1  # ranks that fit would take CPUs, were they placed one by one
    group = LearnerGroup(_settings(tiny_models, 2), ranks, 0.0, placement_timeout_s=6.0)
    free_while_waiting: list[float] = []

    async def attempt() -> None:
        waiting = asyncio.create_task(group.initialize())
        await asyncio.sleep(3)  # inside the placement wait
        free_while_waiting.append(ray.available_resources().get("CPU", 0.0))
        await waiting

    with pytest.raises(ConfigError) as error:
        asyncio.run(attempt())
    assert free_while_waiting == [free_before], "ranks took CPUs while the others could not be placed"
    assert error.value.field == "resources.learner_gpus"
    assert f"{ranks} learner rank(s) (all {ranks} at once)" in error.value.message
    assert placement_group_table(group.group)["state"] == "REMOVED"
    group.shutdown()  # after a failed placement too
