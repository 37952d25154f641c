"""`weight_sync/transports.py`: which transport each replica gets, and the host-memory transports' halves.

The engine half runs against the real `WeightReloadExtension` over a stand-in for vLLM's model runner
(what `collective_rpc` would reach in every worker), so the handoff, the RPC name and the extension's
checks meet as in an engine. Ray's object store is stubbed here (a local `ray.init` costs ~15 s on
this box); `tests/integration/test_engine.py` runs both transports through a real engine actor.
"""

from __future__ import annotations

import asyncio
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from opd_trainer.driver.publish import publish_weights
from opd_trainer.errors import WeightSyncError
from opd_trainer.jobspec.job_spec import Resources
from opd_trainer.weight_sync import transports
from opd_trainer.weight_sync.base import SHM_DIR_ENV
from opd_trainer.weight_sync.transports import (
    WEIGHT_TRANSFERS,
    RayHandoff,
    RayTransfer,
    ShmHandoff,
    ShmTransfer,
    apply_weights,
    check_transfer_available,
    export_weights,
    release_weights,
    transfer,
    transfer_for,
)
from opd_trainer.weight_sync.worker_extension import WeightReloadExtension


def _weights(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.arange(12, dtype=torch.float32).reshape(4, 3) * scale,
        "model.norm.weight": torch.ones(3) * scale,
    }


class _ModelRunner:
    """What `WeightReloadExtension` uses of vLLM's model runner: the served checkpoint's folder and
    `reload_weights`, which here records what it was given."""

    def __init__(self, model_dir: Path) -> None:
        self.model_config = SimpleNamespace(
            model=str(model_dir), hf_config=SimpleNamespace(tie_word_embeddings=False)
        )
        self.loaded: dict[str, torch.Tensor] = {}

    def reload_weights(self, weights_iterator: Any) -> None:
        self.loaded = {name: tensor.clone() for name, tensor in weights_iterator}

    def get_model(self) -> Any:
        return SimpleNamespace()


class _Worker(WeightReloadExtension):
    def __init__(self, model_dir: Path) -> None:
        self.model_runner = _ModelRunner(model_dir)  # type: ignore[assignment]


class _Engine:
    """Stands for vLLM's `AsyncLLM`: `collective_rpc` calls the method on each worker."""

    def __init__(self, model_dir: Path, workers: int = 2) -> None:
        self.workers = [_Worker(model_dir) for _ in range(workers)]

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [getattr(worker, method)(*args) for worker in self.workers]

    def loaded(self) -> list[dict[str, torch.Tensor]]:
        return [worker.model_runner.loaded for worker in self.workers]  # type: ignore[attr-defined]


@pytest.fixture
def engine(tmp_path: Path) -> _Engine:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file(_weights(), str(model_dir / "model.safetensors"))
    return _Engine(model_dir)


def _assert_loaded(engine: _Engine, expected: dict[str, torch.Tensor]) -> None:
    for loaded in engine.loaded():
        assert set(loaded) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(loaded[name], tensor)


# -- which transport ------------------------------------------------------------------------------


def test_auto_uses_shared_memory_only_on_the_learners_node() -> None:
    assert transfer_for("auto", "node-a", "node-a") == "shm"
    assert transfer_for("auto", "node-a", "node-b") == "ray"


def test_explicit_choices() -> None:
    assert transfer_for("ray", "node-a", "node-a") == "ray"
    assert transfer_for("shm", "node-a", "node-a") == "shm"
    with pytest.raises(ValueError, match="learner's node"):
        transfer_for("shm", "node-a", "node-b")
    assert transfer_for("nccl", "node-a", "node-b") == "nccl"
    assert transfer_for("cuda_ipc", "node-a", "node-a") == "cuda_ipc"
    with pytest.raises(ValueError, match="learner's node"):
        transfer_for("cuda_ipc", "node-a", "node-b")
    with pytest.raises(ValueError, match="unknown weight transfer"):
        transfer_for("gloo", "node-a", "node-a")


def test_gpu_transports_are_refused_without_cuda_naming_the_field() -> None:
    for kind in ("cuda_ipc", "nccl"):
        with pytest.raises(ValueError, match=r"resources\.weight_transfer .*needs CUDA"):
            check_transfer_available(kind, cuda_available=False)
        check_transfer_available(kind, cuda_available=True)
    for kind in ("auto", "shm", "ray"):
        check_transfer_available(kind, cuda_available=False)


def test_the_job_field_speaks_the_modules_vocabulary() -> None:
    assert Resources().weight_transfer == "auto"
    annotation = Resources.model_fields["weight_transfer"].annotation
    assert typing.get_args(annotation) == WEIGHT_TRANSFERS == ("auto", "shm", "ray", "cuda_ipc", "nccl")
    with pytest.raises(ValidationError, match="weight_transfer"):
        Resources.model_validate({"weight_transfer": "gloo"})


def test_each_kind_names_its_transport_and_auto_is_not_one() -> None:
    assert isinstance(transfer("shm"), ShmTransfer) and isinstance(transfer("ray"), RayTransfer)
    assert ShmHandoff.kind == ShmTransfer.kind == "shm" and RayHandoff.kind == RayTransfer.kind == "ray"
    for kind in ("auto", "gloo"):
        with pytest.raises(WeightSyncError, match="unknown weight transfer"):
            transfer(kind)


# -- shm: both halves -----------------------------------------------------------------------------


def test_shm_export_apply_release(tmp_path: Path, engine: _Engine) -> None:
    shm = ShmTransfer(tmp_path / "shm")
    new = _weights(2.0)
    handoff = shm.export(new.items())
    assert isinstance(handoff, ShmHandoff) and Path(handoff.path).is_file()
    assert handoff.num_tensors == 2 and handoff.num_bytes == (12 + 3) * 4
    assert not list((tmp_path / "shm").glob("*.partial"))

    asyncio.run(shm.apply(handoff, engine, "student-0"))  # type: ignore[arg-type]
    _assert_loaded(engine, new)

    shm.release(handoff)
    assert not Path(handoff.path).exists()
    shm.release(handoff)  # twice is harmless


def test_shm_apply_refuses_weights_the_engine_does_not_serve(tmp_path: Path, engine: _Engine) -> None:
    shm = ShmTransfer(tmp_path)
    for broken in (
        {**_weights(), "model.norm.weight": torch.ones(5)},
        {**_weights(), "model.layers.9.mlp.up_proj.weight": torch.ones(2)},
    ):
        with shm.exported(broken.items()) as handoff, pytest.raises(WeightSyncError, match="student-0"):
            asyncio.run(shm.apply(handoff, engine, "student-0"))  # type: ignore[arg-type]
        assert not Path(handoff.path).exists()
    assert engine.loaded() == [{}, {}]  # nothing was half-applied


# -- ray: both halves (the object store stubbed: `ray.put` hands back an awaitable, as an ObjectRef) --


def _resolved(value: Any) -> asyncio.Future[Any]:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


def test_ray_export_apply_stages_on_the_engines_tmpfs(
    tmp_path: Path, engine: _Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    staging = tmp_path / "staging"
    new = _weights(3.0)

    async def round_trip() -> RayHandoff:
        monkeypatch.setattr(transports.ray, "put", _resolved)
        handoff = RayTransfer().export(new.items())
        assert handoff.num_tensors == 2 and handoff.num_bytes == (12 + 3) * 4
        await RayTransfer(staging).apply(handoff, engine, "student-1")  # type: ignore[arg-type]
        return handoff

    handoff = asyncio.run(round_trip())
    _assert_loaded(engine, new)
    assert staging.is_dir() and not list(staging.iterdir())  # the staged copy is gone after the load
    RayTransfer().release(handoff)  # nothing to free: the object goes with its last reference


# -- the learner's and the engine's entry points --------------------------------------------------


def test_export_weights_makes_one_handoff_per_kind_and_release_frees_them(
    tmp_path: Path, engine: _Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path / "shm"))
    new = _weights(4.0)

    async def run() -> dict[str, Any]:
        monkeypatch.setattr(transports.ray, "put", _resolved)
        handoffs = export_weights(iter(new.items()), ["shm", "ray", "shm"])
        for handoff in handoffs.values():
            await apply_weights(handoff, engine, "student-0")  # type: ignore[arg-type]
            _assert_loaded(engine, new)
        return handoffs

    handoffs = asyncio.run(run())
    assert sorted(handoffs) == ["ray", "shm"]
    assert isinstance(handoffs["shm"], ShmHandoff) and isinstance(handoffs["ray"], RayHandoff)
    release_weights(handoffs.values())
    assert not list((tmp_path / "shm").iterdir())


class _Learner:
    def __init__(self, tmp_path: Path) -> None:
        self.shm = ShmTransfer(tmp_path)
        self.released: list[Any] = []

    async def export_weights(self, kinds: list[str]) -> dict[str, Any]:
        return {kind: self.shm.export(_weights().items()) for kind in set(kinds)}

    async def release_weights(self, handoffs: list[Any]) -> None:
        self.released += handoffs
        release_weights(handoffs)


class _Student:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.got: list[Any] = []

    async def update_weights(self, handoffs: list[Any], version: int) -> None:
        self.got = [*handoffs, version]
        if self.fail:
            raise WeightSyncError("engines report versions [6], expected 7")


@pytest.mark.parametrize("fail", [False, True])
def test_publish_weights_exports_updates_and_always_releases(tmp_path: Path, fail: bool) -> None:
    learner, student = _Learner(tmp_path), _Student(fail)

    async def publish() -> None:
        await publish_weights(learner, student, ["shm", "shm"], 7)  # type: ignore[arg-type]

    if fail:
        with pytest.raises(WeightSyncError):
            asyncio.run(publish())
    else:
        asyncio.run(publish())
    [handoff] = learner.released
    assert student.got == [handoff, handoff, 7]
    assert not Path(handoff.path).exists()
