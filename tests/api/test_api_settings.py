"""Server settings: `OPD_*` variables, `DATABASE_URL`, and fail-fast validation (no server needed)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from pydantic import ValidationError

from api.settings import Settings
from opd_trainer.cli.main import main


def test_environment_and_database_url_alias(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OPD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("OPD_MAX_CONCURRENT_JOBS", "0")
    monkeypatch.setenv("OPD_ADMIN_KEY", "")  # empty means unset (Helm renders it so)
    settings = Settings()
    assert settings.sqlalchemy_url == f"sqlite:///{tmp_path / 'data' / 'opd.db'}"
    assert settings.admin_key is None and not settings.scheduler_enabled
    monkeypatch.setenv("DATABASE_URL", "postgresql+psycopg://opd:pw@db/opd")
    assert Settings().sqlalchemy_url == "postgresql+psycopg://opd:pw@db/opd"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("admin_key", "short"),
        ("database_url", "mysql://x"),
        ("max_concurrent_jobs", -1),
        ("workspace_max_compression_ratio", 1),
        ("max_body_bytes", 10),
        ("cancel_grace_s", 0),
        ("driver_unresponsive_s", 0),
        ("max_concurrent_jobs_per_tenant", 0),
    ],
)
def test_bad_settings_fail_fast(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as raised:
        Settings(**{field: value})
    assert raised.value.errors()[0]["loc"][0] in {field, "database_url"}


def test_a_driver_is_given_more_than_one_poll_to_answer() -> None:
    with pytest.raises(ValidationError, match="driver_unresponsive_s must exceed poll_interval_s"):
        Settings(poll_interval_s=5, driver_unresponsive_s=5)
    assert Settings(poll_interval_s=5, driver_unresponsive_s=6).driver_unresponsive_s == 6


def test_serve_refuses_bad_settings_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OPD_ADMIN_KEY", "short")
    assert main(["serve", "--max-concurrent-jobs", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: OPD_ADMIN_KEY: Value error, must be at least 16")


def test_serve_refuses_a_taken_port_before_it_starts_anything(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # Settings that would start Ray (max concurrent jobs > 0): the port is checked first.
        assert main(["serve", "--port", str(port)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: --port: cannot listen on 127.0.0.1:{port}: ")
    assert "in use" in error


def test_tracker_allowed_uris_is_a_comma_separated_list_of_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().tracker_allowed_uris == []
    monkeypatch.setenv("OPD_TRACKER_ALLOWED_URIS", "http://mlflow.internal:5000, https://mlflow.example.com")
    assert Settings().tracker_allowed_uris == ["http://mlflow.internal:5000", "https://mlflow.example.com"]
    monkeypatch.setenv("OPD_TRACKER_ALLOWED_URIS", "http://mlflow.internal:5000,sqlite:///srv/opd.db")
    with pytest.raises(ValidationError, match="not a tracking server"):  # a file store: never
        Settings()
