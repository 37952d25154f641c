"""`model` as a Hugging Face id: resolved through the hub cache by huggingface_hub itself (a local
folder laid out as a cache entry stands in for a download, since nothing here reaches the hub)."""

from __future__ import annotations

from pathlib import Path

import pytest

from opd_trainer.errors import ConfigError
from opd_trainer.spec.model_source import hub_snapshot, is_hub_id, local_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


def cache_entry(cache: Path, repo: str, files: dict[str, str]) -> Path:
    """A hub cache entry as `hf download` leaves it: refs/main → snapshots/REVISION."""
    entry = cache / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for name, content in files.items():
        (snapshot / name).write_text(content)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # never the network here
    return cache


def test_a_cached_id_resolves_to_its_snapshot_folder(hub_cache: Path) -> None:
    snapshot = cache_entry(hub_cache, "tiny-org/student", {"config.json": "{}"})
    assert hub_snapshot("tiny-org/student", "model", download=False) == snapshot
    assert hub_snapshot(f"tiny-org/student@{REVISION}", "model", download=False) == snapshot
    assert local_model("tiny-org/student", "model", download=False) == str(snapshot)


def test_an_id_missing_from_the_cache_names_the_field_and_what_to_do(hub_cache: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        hub_snapshot("tiny-org/absent", "teacher_model", download=False)
    assert raised.value.field == "teacher_model"
    assert "not in the server's Hugging Face cache" in raised.value.message
    assert "hf download tiny-org/absent" in raised.value.message
    with pytest.raises(ConfigError, match="could not be downloaded"):  # opd train, offline
        hub_snapshot("tiny-org/absent", "model", download=True)


def test_folders_are_not_hub_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "student").mkdir(parents=True)
    assert not is_hub_id("models/student")  # an existing relative folder wins
    assert not is_hub_id("/abs/models/student") and not is_hub_id("./student") and not is_hub_id("student")
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("org/name@v1.0")
    assert local_model(str(tmp_path / "models" / "student"), "model", download=False) == str(
        tmp_path / "models" / "student"
    )
