"""The job driver reports a Bailian job's ignored fields once per job, also across a resumed run.

`opd_trainer.driver.job_driver` pulls in transformers, so it is imported inside the tests: unit tests must
not be affected by it being imported at collection time (see tests/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from opd_trainer.jobspec.job_spec import JobSpec, parse_job_spec


def _spec(tmp_path: Path, **extra: object) -> JobSpec:
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    return parse_job_spec(
        {"job_name": "j", "model": "s", "teacher_model": "t", "training_datasets": [str(train)], **extra}
    )


def test_ignored_fields_are_one_warning_per_job(tmp_path: Path) -> None:
    from opd_trainer.driver.job_driver import JobDriver

    spec = _spec(
        tmp_path,
        resources={"charge_type": "mtu_postpaid", "mtu_spec_code": "MTU4", "mtu_capacity": 24},
        hyper_parameters={"opd_teacher_replicas": 2},
    )
    driver = JobDriver(spec, str(tmp_path / "run"))
    driver._report_ignored_fields()
    driver._report_ignored_fields()
    [event] = driver.events()
    assert event.type == "warning"
    for path in ("resources.charge_type", "resources.mtu_spec_code", "resources.mtu_capacity"):
        assert path in event.message
    assert event.data["ignored_fields"]["hyper_parameters.opd_teacher_replicas"] == 2

    resumed = JobDriver(spec, str(tmp_path / "run"))  # a new driver on the same run dir (server restart)
    resumed._report_ignored_fields()
    assert resumed.events() == []
    lines = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["type"] for line in lines] == ["warning"]


def test_a_job_without_them_reports_nothing(tmp_path: Path) -> None:
    from opd_trainer.driver.job_driver import JobDriver

    driver = JobDriver(_spec(tmp_path), str(tmp_path / "run"))
    driver._report_ignored_fields()
    assert driver.events() == []
