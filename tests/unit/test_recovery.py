"""The recovery rules without Ray running: which errors are a lost component, the budget and the
repeat rule (kept in the run directory across driver incarnations), and the meter carried over."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, NodeDiedError, RayTaskError

from opd_trainer.driver.metering import RECORDED, Meter
from opd_trainer.driver.recovery import Lost, RecoveryLog, _death_details, cause_of, death_error
from opd_trainer.errors import OPDError


def test_a_death_is_found_behind_causes_task_errors_and_groups() -> None:
    died = ActorDiedError()
    try:
        try:
            raise died
        except ActorDiedError as exc:
            raise OPDError("step 2: 4/4 rollouts failed") from exc
    except OPDError as wrapped:
        assert death_error(wrapped) is died
    task_error = RayTaskError("score_many", "traceback", NodeDiedError("node gone"))
    assert isinstance(death_error(task_error), NodeDiedError)
    assert death_error(ExceptionGroup("steps", [ValueError("x"), died])) is died
    assert death_error(OPDError("no segment left to train")) is None
    assert death_error(ValueError("bad value")) is None


def test_rays_reason_and_place_are_read_from_its_message() -> None:
    text = (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: EngineActor\n"
        "\tpid: 4321\n\tip: 10.0.0.7\nThe actor is dead because it was killed by `ray.kill`."
    )
    assert _death_details(RuntimeError(text)) == ("ip 10.0.0.7 pid 4321", "it was killed by `ray.kill`")
    lost = Lost("learner rank 1", "ip 10.0.0.7 pid 4321", "its node died")
    assert lost.describe() == "learner rank 1 (ip 10.0.0.7 pid 4321, its node died)"
    assert cause_of([lost, Lost("gateway host 0", "", "x")], None) == "gateway host 0, learner rank 1"
    assert cause_of([], NodeDiedError("node gone")) == "NodeDiedError"


@pytest.mark.parametrize("budget", [0, 2])
def test_the_budget_and_the_repeat_rule_hold_across_incarnations(tmp_path: Path, budget: int) -> None:
    log = RecoveryLog(tmp_path)
    if budget == 0:
        assert "max_recoveries=0" in (log.refusal(3, "student engine replica 0", budget) or "")
        return
    assert log.refusal(3, "student engine replica 0", budget) is None
    assert log.add(3, "student engine replica 0", "lost", resumes_from=2) == 1
    again = RecoveryLog(tmp_path)  # a new driver on the same run directory reads the history
    assert "a second time" in (again.refusal(3, "student engine replica 0", budget) or "")
    assert again.refusal(4, "student engine replica 0", budget) is None  # another step: recover
    assert again.refusal(3, "learner rank 0", budget) is None  # another component: recover
    with log.path.open("a") as out:
        out.write('{"step": 5, "cau')  # a line half-written when the process died is skipped
    assert again.add(4, "learner rank 0", "lost", resumes_from=4) == 2
    assert "2 recoveries already" in (again.refusal(9, "gateway host 0", budget) or "")


def test_a_carried_over_meter_counts_on_from_the_last_read() -> None:
    meter = Meter(dict.fromkeys(RECORDED, 1.0))
    meter._driver_cpu_read = 2.5  # this process's CPU at the last read
    carried = meter.carried_over({**dict.fromkeys(RECORDED, 3.0), "teacher_tokens": 140.0})
    assert carried.base["teacher_tokens"] == 140.0 and carried._driver_cpu_base == 2.5
    assert carried._started == meter._last_read  # the wall clock goes on from that read
    assert carried.deltas({k: v + 1 for k, v in carried.base.items()})["usage/teacher_tokens"] == 1.0


def test_a_placement_that_timed_out_is_the_jobs_error_not_a_lost_part(tmp_path: Path) -> None:
    """`placed` kills the actors it could not place and raises ConfigError naming the field: those
    actors are dead, but restarting would only wait again; the job fails with the field."""
    import asyncio

    from opd_trainer.driver.job_driver import JobDriver
    from opd_trainer.errors import ConfigError
    from opd_trainer.jobspec.job_spec import parse_job_spec

    spec = parse_job_spec(
        {"job_name": "j", "model": "/m/s", "teacher_model": "/m/t", "training_datasets": ["/d.jsonl"]}
    )
    driver = JobDriver(spec, str(tmp_path / "run"))
    error = ConfigError("Ray could not place the student engines within 600s", field="resources.student")
    assert asyncio.run(driver._recover(error)) is False
    assert RecoveryLog(tmp_path / "run").entries() == []


def test_a_part_that_fails_to_start_cancels_the_parts_still_starting() -> None:
    """What a failed (re)start leaves is only what `Started.stop()` stops: an engine still starting
    when the learner's placement failed is cancelled (its actors killed), not left to come up later."""
    import asyncio

    from opd_trainer.driver.components import all_or_none

    finished: list[str] = []

    async def engine() -> None:
        await asyncio.sleep(0.5)
        finished.append("engine")

    async def learner() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("placement failed")

    async def scenario() -> None:
        with pytest.raises(RuntimeError):
            await all_or_none(engine(), learner())
        await asyncio.sleep(0.7)

    asyncio.run(scenario())
    assert finished == []
    assert asyncio.run(all_or_none(asyncio.sleep(0, "a"), asyncio.sleep(0, "b"))) == ["a", "b"]


class _Ready:
    """A stand-in actor whose readiness call raises each of `answers` in turn, then answers."""

    def __init__(self, *answers: BaseException) -> None:
        self.answers = list(answers)
        self.__ray_ready__ = self

    async def _answer(self) -> bool:
        if self.answers:
            raise self.answers.pop(0)
        return True

    def remote(self) -> Any:
        return self._answer()


def test_an_unavailable_actor_is_lost_only_once_ray_says_it_died_or_it_stays_so() -> None:
    import asyncio

    from ray.exceptions import ActorUnavailableError

    from opd_trainer.driver.recovery import probe

    def unavailable() -> ActorUnavailableError:
        return ActorUnavailableError("Connection refused rpc_code: 14", None)

    actors = {
        "back": _Ready(unavailable()),  # a blip: answers on the next try
        "died": _Ready(unavailable(), ActorDiedError()),  # its node's death confirmed
        "gone": _Ready(*(unavailable() for _ in range(100))),  # never answers again
    }
    lost = asyncio.run(probe(actors, timeout_s=5, unavailable_s=2.5))
    assert [item.name for item in lost] == ["died", "gone"]
    assert "unreachable for 2.5s" in lost[1].why
