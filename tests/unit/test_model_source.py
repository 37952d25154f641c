"""`model` as a Hugging Face id: resolved through the hub cache by huggingface_hub itself (a local
folder laid out as a cache entry stands in for a download, since nothing here reaches the hub)."""

from __future__ import annotations

from pathlib import Path

import pytest

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.model_source import hub_snapshot, is_hub_id, local_model

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


CRAFTED_REVISIONS = [
    "/etc",
    "/nonexistent",
    "../../outside",
    ".hidden",
    "main/../..",
    "a/b",
    "a..b",
    "",
    "x\n",
]


@pytest.mark.parametrize("revision", CRAFTED_REVISIONS)
def test_a_revision_outside_the_safe_characters_is_refused_before_any_lookup(
    hub_cache: Path, revision: str
) -> None:
    """Paths, `..`, a leading `.`, `/` and a trailing newline: one message, naming the field, that
    quotes no path and reads the same whether the path it would reach exists (`/etc`) or not."""
    cache_entry(hub_cache, "tiny-org/student", {"config.json": "{}"})
    value = f"tiny-org/student@{revision}"
    assert is_hub_id(value)  # refused as a hub id, not let through as a path
    with pytest.raises(ConfigError) as raised:
        hub_snapshot(value, "teacher_model", download=False)
    assert raised.value.field == "teacher_model"
    assert raised.value.message == (
        "the revision of Hugging Face id tiny-org/student is not a commit hash, branch or tag name: use "
        "letters, digits, '.', '_' and '-' only (no '/', no '..', not starting with '.'); name a branch "
        "with '/' by its commit hash"
    )


def test_safe_revisions_resolve_a_commit_and_a_tag(hub_cache: Path) -> None:
    snapshot = cache_entry(hub_cache, "tiny-org/student", {"config.json": "{}"})
    (snapshot.parent.parent / "refs" / "v1.0_rc-2").write_text(REVISION)
    assert hub_snapshot("tiny-org/student@v1.0_rc-2", "model", download=False) == snapshot
    assert hub_snapshot(f"tiny-org/student@{REVISION}", "model", download=False) == snapshot


def test_repository_names_are_ascii_without_dot_dot(hub_cache: Path) -> None:
    for value in ("tiny-org/a..b", "tïny/model"):
        with pytest.raises(ConfigError, match="not a Hugging Face id") as raised:
            hub_snapshot(value, "model", download=False)
        assert raised.value.field == "model"


def test_a_snapshot_that_resolves_outside_the_hub_cache_is_refused_without_naming_it(
    hub_cache: Path, tmp_path: Path
) -> None:
    """A ref whose content climbs out of `snapshots/`, and a snapshot folder that is a link out of the
    cache: both lead to a real model folder elsewhere (another tenant's upload) and are refused as
    'not in the cache', with no path in the message."""
    outside = tmp_path / "data" / "uploaded-models" / "file-other" / "model"
    outside.mkdir(parents=True)
    (outside / "config.json").write_text("{}")
    snapshot = cache_entry(hub_cache, "tiny-org/student", {"config.json": "{}"})
    entry = snapshot.parent.parent
    climbing = "../../../data/uploaded-models/file-other/model"
    assert (entry / "snapshots" / climbing).resolve() == outside  # the lookup would land there
    (entry / "refs" / "climb").write_text(climbing)
    linked = "fedcba9876543210fedcba9876543210fedcba98"
    (entry / "snapshots" / linked).symlink_to(outside, target_is_directory=True)
    for value in ("tiny-org/student@climb", f"tiny-org/student@{linked}"):
        with pytest.raises(ConfigError) as raised:
            hub_snapshot(value, "model", download=False)
        assert raised.value.field == "model"
        assert "not in the server's Hugging Face cache" in raised.value.message
        assert str(tmp_path) not in raised.value.message and "uploaded-models" not in raised.value.message


def test_the_servers_lookup_errors_quote_no_cache_path(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OS error inside the cache lookup names a cache path: the server says only 'not in the cache',
    `opd train` (download=True, the user's own machine) keeps the detail."""
    import huggingface_hub

    def failing(*args: object, **kwargs: object) -> str:
        raise PermissionError(f"[Errno 13] Permission denied: '{hub_cache}/models--tiny-org--student'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(ConfigError) as raised:
        hub_snapshot("tiny-org/student", "model", download=False)
    assert "not in the server's Hugging Face cache" in raised.value.message
    assert str(hub_cache) not in raised.value.message
    with pytest.raises(ConfigError, match="Permission denied"):
        hub_snapshot("tiny-org/student", "model", download=True)
