"""A job's engines from start to stop (`engine/fleet.py`) and what an engine hosts (`engine/hosting.py`),
with stand-in actors: the groups a job started stop with it, once each; the shared ones are released."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from opd_trainer.engine import fleet
from opd_trainer.engine.adapters import BASE_MODEL_CLIENT, OWN_JOB
from opd_trainer.engine.fleet import EngineFleet
from opd_trainer.engine.hosting import HostedServices
from opd_trainer.engine.vllm_engine import ClientEngineGroup, EngineConfig


class _Remote:
    def __init__(self, actor: _Actor, method: str) -> None:
        self.actor, self.method = actor, method

    async def remote(self, *args: Any) -> None:
        self.actor.calls.append((self.actor.name, self.method, args))


class _Actor:
    """A stand-in engine (or registry) actor: records the calls made on it."""

    def __init__(self, name: str, calls: list[tuple[str, str, Any]]) -> None:
        self.name, self.calls = name, calls

    def __getattr__(self, method: str) -> _Remote:
        return _Remote(self, method)


def test_a_fleet_stops_the_groups_it_started_once_and_releases_the_shared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, str, Any]] = []

    async def start(config: EngineConfig, name: str) -> tuple[list[Any], list[str]]:
        return [_Actor(f"{name}-0", calls)], ["node"]

    monkeypatch.setattr(fleet, "start_replicas", start)
    monkeypatch.setattr(fleet.ray, "kill", lambda actor: calls.append((actor.name, "kill", ())))
    registry = _Actor("registry", calls)

    async def scenario() -> EngineFleet:
        jobs = EngineFleet("job-a")
        own = await jobs.start(EngineConfig(model="unused"), "job-a-student")
        student, base = jobs.split(own, [OWN_JOB, BASE_MODEL_CLIENT])
        assert isinstance(student, ClientEngineGroup) and (student.client, base.client) == (
            OWN_JOB,
            BASE_MODEL_CLIENT,
        )
        assert student.actors == base.actors == own.actors and jobs.groups == [student]
        jobs.registries["teacher"] = registry  # as `acquire` leaves it
        await jobs.stop()
        return jobs

    jobs = asyncio.run(scenario())
    assert sorted(calls) == [
        ("job-a-student-0", "kill", ()),
        ("job-a-student-0", "shutdown", ()),
        ("registry", "release", ("job-a",)),
    ]
    assert jobs.groups == [] and jobs.registries == {}


class _Service:
    def __init__(self, stopped: list[str], name: str) -> None:
        self.stopped, self.name = stopped, name

    def sync_method(self, value: int) -> int:
        return value + 1

    async def async_method(self, value: int) -> int:
        return value * 2

    async def shutdown(self) -> None:
        self.stopped.append(self.name)


def test_hosted_services_are_called_by_name_and_stopped_last_added_first() -> None:
    stopped: list[str] = []

    async def build() -> _Service:
        return _Service(stopped, "built")

    async def scenario() -> tuple[int, int]:
        services = HostedServices()
        await services.add("plain", _Service(stopped, "plain"))
        await services.add("built", build())  # a builder may be async
        with pytest.raises(ValueError, match="hosted here already"):
            await services.add("plain", _Service(stopped, "again"))
        with pytest.raises(ValueError, match="no service 'other'"):
            await services.call("other", "sync_method", 1)
        results = (
            await services.call("plain", "sync_method", 1),
            await services.call("built", "async_method", 4),
        )
        await services.shutdown()
        return results

    assert asyncio.run(scenario()) == (2, 8)
    assert stopped == ["built", "plain"]
