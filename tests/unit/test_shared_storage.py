"""The run-dir probe: a reader that does not see the token the server wrote fails naming itself,
its host and what to mount; a driver that cannot see its run dir reports that as the job's error."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from opd_trainer.errors import ConfigError
from opd_trainer.storage.shared import PROBE_FILE, check_probe, write_probe


def test_a_reader_that_sees_the_token_passes(tmp_path: Path) -> None:
    token = write_probe(tmp_path / "run")
    check_probe(tmp_path / "run", token, "learner rank 1")


@pytest.mark.parametrize("found", ["none", "older"])
def test_a_reader_that_does_not_see_it_fails_naming_itself_and_the_mount(tmp_path: Path, found: str) -> None:
    run = tmp_path / "run"
    if found == "older":
        write_probe(run)  # a previous incarnation's token: this disk is not the one just written
    with pytest.raises(ConfigError) as raised:
        check_probe(run, "a-token-written-elsewhere", "learner rank 1")
    message = str(raised.value)
    assert raised.value.field == "run_dir"
    assert f"learner rank 1 on host {socket.gethostname()}" in message and str(run) in message
    assert ("an older probe written on" in message) == (found == "older")
    assert "OPD_DATA_DIR" in message and "mountDataVolume" in message


def test_each_write_is_a_new_token(tmp_path: Path) -> None:
    first, second = write_probe(tmp_path), write_probe(tmp_path)
    assert first != second
    assert json.loads((tmp_path / PROBE_FILE).read_text())["token"] == second


def test_a_driver_that_cannot_see_its_run_dir_fails_the_job_with_that_error(tmp_path: Path) -> None:
    from opd_trainer.driver.job_driver import JobDriver
    from opd_trainer.jobspec.job_spec import parse_job_spec

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    spec = parse_job_spec(
        {
            "job_name": "j",
            "model": str(tmp_path),
            "teacher_model": str(tmp_path),
            "training_datasets": [str(data)],
        }
    )
    run = tmp_path / "elsewhere" / "run"  # never written on this "node"
    driver = JobDriver(spec, str(run), "job-1", storage_token="written-by-the-server")
    with pytest.raises(ConfigError, match="job driver on host"):
        asyncio.run(driver.run())
    assert driver.progress().status == "failed"
    [error] = [e for e in driver.events() if e.type == "error"]
    assert error.data["field"] == "run_dir"
    assert not run.exists(), "nothing was written to a run dir the server does not read"
