"""Ctrl-C while following a job: the CLI says the job goes on, and how to follow or stop it."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from opd_trainer.cli import client_commands
from opd_trainer.wire.schemas import EventPublic


class InterruptedStream:
    """A client whose live stream is interrupted by the user after one event."""

    def iter_events(self, job_id: str, after: int = 0) -> Iterator[EventPublic]:
        yield EventPublic(id=1, time=0.0, type="status", message="queued")

    def stream_events(self, job_id: str, after: int = 0) -> Iterator[EventPublic]:
        assert after == 1  # the stream continues after the last event paged
        yield EventPublic(id=2, time=1.0, type="step", message="step 1/4")
        raise KeyboardInterrupt


def test_ctrl_c_in_logs_follow_says_the_job_keeps_running(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(client_commands, "_client", lambda args: InterruptedStream())
    args = argparse.Namespace(job_id="opdjob-1", follow=True, output="text")
    assert client_commands._logs(args) == 130
    captured = capsys.readouterr()
    assert "[status] queued" in captured.out and "[step] step 1/4" in captured.out
    assert "job opdjob-1 keeps running on the server" in captured.err
    assert "opd cancel opdjob-1" in captured.err
