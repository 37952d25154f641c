"""Shared real components for integration tests: one local Ray, one teacher and one student engine.

vLLM engines take ~20 s each to start on CPU, so they are session-scoped and shared.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import ray
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from opd_trainer.cluster.ray_runtime import init_ray, shutdown_ray
from opd_trainer.demo.tiny_models.serving import tiny_engine_config
from opd_trainer.engine.fleet import start_replicas
from opd_trainer.engine.vllm_engine import EngineConfig

if TYPE_CHECKING:
    from opd_trainer.demo.tiny_models import TinyModels


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    init_ray()
    yield
    shutdown_ray()


def _start(config: EngineConfig, role: str) -> Any:
    [actor], _ = asyncio.run(start_replicas(config, role))
    return actor


@pytest.fixture(scope="session")
def teacher_engine(ray_session: None, tiny_models: TinyModels) -> Iterator[Any]:
    actor = _start(tiny_engine_config(tiny_models.teacher), "teacher")
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


@pytest.fixture(scope="session")
def student_engine(ray_session: None, tiny_models: TinyModels) -> Iterator[Any]:
    actor = _start(tiny_engine_config(tiny_models.student), "student")
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


@pytest.fixture(scope="session")
def tokenizer(tiny_models: TinyModels) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tiny_models.student))
