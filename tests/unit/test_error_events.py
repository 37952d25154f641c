"""Unit tests for how a failed job's error reaches its events: one line, details apart.

`opd_trainer.driver.job_driver` pulls in transformers, so it is imported inside the tests (see
tests/conftest.py and test_job_driver_ignored_fields.py).
"""

from __future__ import annotations

import time

from ray.exceptions import RayTaskError

from api.services.jobs import format_log_line
from opd_trainer.errors import ConfigError, ProcessorLoadError
from opd_trainer.wire.schemas import EventPublic

TRACEBACK = 'Traceback (most recent call last):\n  File "functions/needs.py", line 1\nModuleNotFoundError: x'


def test_a_load_error_re_raised_by_ray_is_one_line_with_the_traceback_in_detail() -> None:
    from opd_trainer.driver.job_driver import error_event

    error = ProcessorLoadError(
        "cannot load classpath 'functions.needs.Needs': it imports 'x', which is not installed\n" + TRACEBACK,
        field="functions.agent.fcmodel.classpath",
    )
    # What the driver catches when the worker actor raised it: Ray's dual class, str() = Ray's traceback.
    wrapped = RayTaskError("ProcessorWorker.load", "ray traceback (pid=1, ip=x)", error).as_instanceof_cause()
    assert isinstance(wrapped, ProcessorLoadError) and "ray traceback" in str(wrapped)
    message, data = error_event(wrapped)
    assert message == (
        "functions.agent.fcmodel.classpath: cannot load classpath 'functions.needs.Needs': "
        "it imports 'x', which is not installed"
    )
    assert data == {"field": "functions.agent.fcmodel.classpath", "detail": TRACEBACK}


def test_a_one_line_error_has_no_detail() -> None:
    from opd_trainer.driver.job_driver import error_event

    assert error_event(ConfigError("max_length too large")) == ("max_length too large", {"field": None})


def test_logs_show_the_detail_indented_under_its_line() -> None:
    event = EventPublic(
        id=3, job_id="j", time=time.time(), type="error", message="f: boom", data={"detail": "a\nb"}
    )
    lines = format_log_line(event).splitlines()
    assert lines[0].endswith("[error] f: boom") and lines[1:] == ["    a", "    b"]
