"""Worker pools on real Ray: user failures contained, dead workers retried, autoscaling, load errors."""

from __future__ import annotations

import ast
import asyncio
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from opd_trainer.errors import ProcessorLoadError
from opd_trainer.jobspec.job_spec import FunctionComponent
from opd_trainer.sdk import AgentOutput, ModelResource, RewardOutput, RolloutOutput, TaskStatus
from reward_workers.pool import RewardPool
from rollout_workers.pool import RolloutPool, RolloutRequest

pytestmark = pytest.mark.integration

PROCESSORS = """
import ast
import asyncio
import os
import time

from opd_trainer.sdk import (AbstractRewardProcessor, AbstractRolloutProcessor, AgentOutput, Reward,
                             RewardOutput, RolloutOutput)


def _reply(rollout_input, text):
    return RolloutOutput(agent_output=AgentOutput(
        messages=[*rollout_input.messages, {"role": "assistant", "content": text}],
        rollout_metrics={"attempt": float(rollout_input.request_metadata.attempt_id)},
    ))


class Echo(AbstractRolloutProcessor):
    async def process(self, rollout_input):
        return _reply(rollout_input, "echo")


class SyncEcho(AbstractRolloutProcessor):
    def process(self, rollout_input):
        time.sleep(0.05)
        return _reply(rollout_input, "sync")


class Raises(AbstractRolloutProcessor):
    async def process(self, rollout_input):
        raise RuntimeError("boom from user code")


class Hangs(AbstractRolloutProcessor):
    async def process(self, rollout_input):
        await asyncio.sleep(60)


class DiesOnFirstAttempt(AbstractRolloutProcessor):
    async def process(self, rollout_input):
        if rollout_input.request_metadata.attempt_id == 0:
            os._exit(1)
        return _reply(rollout_input, "survived")


class BlocksOnFirstSample(AbstractRolloutProcessor):
    async def process(self, rollout_input):
        if rollout_input.request_metadata.sample_id == "s0":
            time.sleep(120)  # synchronous: the worker's event loop stops, asyncio's timeout cannot fire
        return _reply(rollout_input, "not blocked")


class AlwaysDies(AbstractRolloutProcessor):
    async def process(self, rollout_input):
        os._exit(1)


class HogsMemory(AbstractRolloutProcessor):
    async def process(self, rollout_input):
        hog = b"x" * (1536 * 1024 * 1024)  # written, so resident
        await asyncio.sleep(60)
        return _reply(rollout_input, str(len(hog)))


class Probes(AbstractRolloutProcessor):
    # Reports what user code can reach: the file at $PROBE_PATH, its workspace, where it may write.

    async def process(self, rollout_input):
        seen = {"cwd": os.getcwd(), "sandboxed": os.environ.get("OPD_SANDBOXED")}
        try:
            seen["secret"] = open(os.environ["PROBE_PATH"]).read()
        except OSError as exc:
            seen["secret"] = type(exc).__name__
        seen["workspace"] = open("functions/procs.py").read()[:6]
        try:
            open(os.path.join(os.path.dirname(os.environ["PROBE_PATH"]), "written-by-user-code"), "w").close()
            seen["wrote_outside"] = True
        except OSError:
            seen["wrote_outside"] = False
        try:
            with open("scratch.bin", "wb") as scratch:  # beyond the component's disk_size
                scratch.write(b"x" * (48 * 1024 * 1024))
            seen["big_write"] = "fits"
        except OSError as exc:
            seen["big_write"] = exc.strerror
        return _reply(rollout_input, repr(seen))


class Sleeps(AbstractRolloutProcessor):
    async def process(self, rollout_input):
        await asyncio.sleep(1.0)
        return _reply(rollout_input, "slept")


class Constant(AbstractRewardProcessor):
    async def process(self, reward_input):
        return RewardOutput(reward=Reward(reward_score=0.75, reward_metrics={"m": 1.0}))
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("workspace")
    (root / "functions").mkdir()
    (root / "functions" / "__init__.py").write_text("")
    (root / "functions" / "procs.py").write_text(textwrap.dedent(PROCESSORS))
    return root


def _component(
    classpath: str, kind: str = "rollout", timeout: float = 30.0, **runtime: Any
) -> FunctionComponent:
    settings = {
        "cpu": 0.1,
        "memory_size": 512,
        "concurrency": 4,
        "capacity": 1,
        "min_capacity": 1,
        "max_capacity": 1,
        **runtime,
    }
    return FunctionComponent.model_validate(
        {
            "name": "c",
            "type": kind,
            "timeout": timeout,
            "fcmodel": {"zipdir": "unused", "classpath": classpath},
            "runtime": settings,
        }
    )


async def _rollout(pool: RolloutPool, index: int) -> tuple[RolloutOutput, list[Any], int]:
    """One rollout; those started in one loop turn go to the pool together (`RolloutPool.rollouts`).
    No gateway listens at its base URL: its worker cannot close the key and returns no calls."""
    request = RolloutRequest(
        sample_id=f"s{index}",
        rollout_id=f"r{index}",
        messages=[{"role": "user", "content": "hi"}],
        tools=None,
        ground_truth=None,
        rollout_extra={},
        sampling_params={},
        model_resource=ModelResource(model_name="m", base_url="http://127.0.0.1:1/v1", api_key="k"),
    )
    [answer] = pool.rollouts([request], close_secret="unused")
    rollout = await answer
    assert rollout.calls is None
    return rollout.output, rollout.spans, rollout.attempt_id


def _run_pool(pool: Any, body: Any) -> Any:
    async def main() -> Any:
        await pool.start()
        try:
            return await body(pool)
        finally:
            await pool.shutdown()

    return asyncio.run(main())


@pytest.mark.parametrize("classpath", ["functions.procs.Echo", "functions/procs.py:SyncEcho"])
def test_async_and_sync_processors_run(ray_session: None, workspace: Path, classpath: str) -> None:
    pool = RolloutPool("job", _component(classpath), workspace)
    outputs = _run_pool(pool, lambda p: asyncio.gather(*(_rollout(p, i) for i in range(6))))
    for output, spans, attempt in outputs:
        assert output.status == TaskStatus.SUCCESS and attempt == 0
        assert output.agent_output.messages[-1]["role"] == "assistant"
        assert any(span["attributes"].get("opd.rollout_id") for span in spans)  # traced automatically


def test_raising_and_hanging_processors_are_contained(ray_session: None, workspace: Path) -> None:
    raising = RolloutPool("job", _component("functions.procs.Raises"), workspace)
    [(output, _, _)] = _run_pool(raising, lambda p: asyncio.gather(_rollout(p, 0)))
    assert output.status == TaskStatus.FAILED and output.error == "c: RuntimeError: boom from user code"

    hanging = RolloutPool("job", _component("functions.procs.Hangs", timeout=1.0), workspace)
    [(output, _, _)] = _run_pool(hanging, lambda p: asyncio.gather(_rollout(p, 0)))
    assert output.status == TaskStatus.FAILED and "timed out after 1s" in output.error


def test_worker_killed_mid_call_is_replaced_and_retried(ray_session: None, workspace: Path) -> None:
    pool = RolloutPool("job", _component("functions.procs.DiesOnFirstAttempt"), workspace)
    [(output, _, attempt)] = _run_pool(pool, lambda p: asyncio.gather(_rollout(p, 0)))
    assert output.status == TaskStatus.SUCCESS and attempt == 1
    assert output.agent_output.rollout_metrics["attempt"] == 1.0
    assert pool.retries == 1


def test_a_processor_blocking_its_event_loop_fails_its_call_and_the_worker_is_replaced(
    ray_session: None, workspace: Path
) -> None:
    pool = RolloutPool("job", _component("functions.procs.BlocksOnFirstSample", timeout=1.0), workspace)

    async def body(p: RolloutPool) -> tuple[Any, Any, float, int]:
        started = time.monotonic()
        blocked = await _rollout(p, 0)
        elapsed = time.monotonic() - started
        return blocked, await _rollout(p, 1), elapsed, p.size

    (blocked, _, _), (after, _, _), elapsed, size = _run_pool(pool, body)
    assert blocked.status == TaskStatus.FAILED and "did not answer" in blocked.error, blocked.error
    assert elapsed < pool.call_timeout_s + 10  # not the 120 s the processor blocks for
    assert after.status == TaskStatus.SUCCESS  # served by the replacement worker
    assert pool.failures == 1 and size == 1


def test_workers_that_keep_dying_are_replaced_within_max_capacity(ray_session: None, workspace: Path) -> None:
    component = _component("functions.procs.AlwaysDies", concurrency=2, capacity=1, max_capacity=2)
    pool = RolloutPool("job", component, workspace)
    sizes: list[int] = []

    async def body(p: RolloutPool) -> list[Any]:
        calls = asyncio.gather(*(_rollout(p, i) for i in range(8)))
        while not calls.done():
            sizes.append(p.size)
            await asyncio.sleep(0.05)
        return await calls

    outputs = _run_pool(pool, body)
    assert all(o.status == TaskStatus.FAILED and "worker died 3 times" in o.error for o, _, _ in outputs)
    assert max(sizes) <= 2, sizes
    assert pool.failures == 8


def test_a_worker_over_its_memory_size_is_killed_and_its_call_fails(
    ray_session: None, workspace: Path
) -> None:
    pool = RolloutPool("job", _component("functions.procs.HogsMemory", memory_size=1024), workspace)
    [(output, _, _)] = _run_pool(pool, lambda p: asyncio.gather(_rollout(p, 0)))
    assert output.status == TaskStatus.FAILED, output.error
    if "rlimits" in (pool.confinement or ""):  # no cgroup here: the allocation itself is refused
        assert "MemoryError" in output.error, output.error
    else:  # the kernel's limit on the sandbox's group, or the pool's check of its resident memory
        assert "exceeded memory_size 1024 MB" in output.error, output.error
    assert pool.retries == 0  # the call caused it: not retried on another worker


def test_user_code_runs_confined_to_its_workspace_and_scratch(
    ray_session: None, workspace: Path, tmp_path: Path
) -> None:
    from opd_trainer.workers.sandbox import bwrap_problem

    problem = bwrap_problem()
    if problem is not None:  # `make setup` installs bubblewrap where it can (root + apt-get)
        pytest.skip(f"no sandbox on this machine: {problem}")
    secret_dir = tmp_path / "data-dir"
    secret_dir.mkdir()
    (secret_dir / "opd.db").write_text("tenant key hashes")
    component = _component(
        "functions.procs.Probes", env={"PROBE_PATH": str(secret_dir / "opd.db")}, disk_size=32
    )
    pool = RolloutPool("job", component, workspace)
    [(output, _, _)] = _run_pool(pool, lambda p: asyncio.gather(_rollout(p, 0)))
    seen = ast.literal_eval(output.agent_output.messages[-1]["content"])
    assert seen["sandboxed"] == "bwrap" and seen["cwd"] == "/tmp/workspace", seen
    assert seen["secret"] == "FileNotFoundError", seen  # the data dir is not in the sandbox at all
    assert seen["workspace"] == "\nimpor" and seen["wrote_outside"] is False, seen
    assert not (secret_dir / "written-by-user-code").exists()
    assert seen["big_write"] == "No space left on device", seen  # /tmp is disk_size (32 MB)


def test_reward_pool_rewards(ray_session: None, workspace: Path) -> None:
    pool = RewardPool("job", _component("functions.procs.Constant", kind="reward"), workspace)

    async def body(p: RewardPool) -> tuple[RewardOutput, list[Any]]:
        return await p.reward(
            sample_id="s", rollout_id="r", ground_truth="g", agent_output=AgentOutput(messages=[])
        )

    output, _ = _run_pool(pool, body)
    assert output.reward is not None and output.reward.reward_score == 0.75


def test_pool_scales_to_max_under_burst_and_back_to_min(ray_session: None, workspace: Path) -> None:
    events: list[dict[str, Any]] = []
    pool = RolloutPool(
        "job",
        _component("functions.procs.Sleeps", concurrency=1, capacity=1, min_capacity=1, max_capacity=3),
        workspace,
        autoscale_interval_s=0.2,
        scale_down_cooldown_s=2.0,
        on_event=events.append,
    )

    async def body(p: RolloutPool) -> list[int]:
        # 24 one-second calls: a loaded machine that starts a worker in 10 s still reaches the maximum.
        await asyncio.gather(*(_rollout(p, i) for i in range(24)))
        peak = max(h["workers"] for h in p.history)
        for _ in range(120):
            if p.size == 1:
                break
            await asyncio.sleep(0.25)
        return [peak, p.size]

    peak, final = _run_pool(pool, body)
    assert peak == 3 and final == 1
    actions = [e["action"] for e in events]
    assert "up" in actions and "down" in actions
    assert all(1 <= e["to"] <= 3 for e in events)


@pytest.mark.parametrize(
    ("files", "classpath", "fragment"),
    [
        (
            {"functions/__init__.py": "", "functions/a.py": "X = 1\n"},
            "functions.a.Missing",
            "class Missing not found",
        ),
        ({"functions/a.py": "X = 1\n"}, "functions.a.X", "has no __init__.py"),
        (
            {"functions/__init__.py": "", "functions/a.py": "raise ValueError('bad config')\n"},
            "functions.a.X",
            "bad config",
        ),
        (
            {"functions/__init__.py": "", "functions/a.py": "class X:\n    pass\n"},
            "functions.a.X",
            "not a subclass",
        ),
        ({"functions/__init__.py": ""}, "functions.nothere.X", "not found"),
    ],
)
def test_classpath_errors_surface_before_training(
    ray_session: None, tmp_path: Path, files: dict[str, str], classpath: str, fragment: str
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    pool = RolloutPool("job", _component(classpath), tmp_path)
    with pytest.raises(ProcessorLoadError) as raised:
        asyncio.run(pool.start())
    assert fragment in str(raised.value) and classpath in str(raised.value)
    assert raised.value.field is not None and raised.value.field.startswith("functions.c.")


def test_requirements_that_fail_to_install_are_reported(
    ray_session: None, workspace: Path, tmp_path: Path
) -> None:
    (tmp_path / "functions").mkdir()
    (tmp_path / "functions" / "__init__.py").write_text("")
    (tmp_path / "functions" / "procs.py").write_text((workspace / "functions" / "procs.py").read_text())
    (tmp_path / "requirements.txt").write_text("opd-no-such-package-for-tests==0.0.1\n")
    pool = RolloutPool("job", _component("functions.procs.Echo"), tmp_path)
    with pytest.raises(ProcessorLoadError) as raised:
        asyncio.run(pool.start())
    assert "requirements.txt failed to install" in str(raised.value)
    assert raised.value.field == "functions.c.fcmodel"


def test_workers_require_the_user_code_resource_when_it_is_configured(
    ray_session: None, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The Helm chart sets OPD_USER_CODE_RESOURCE to the resource only its user-code pods (no data volume)
    # advertise. No node here has it, so the worker cannot be placed, and the error names it.
    from opd_trainer.workers import pool as worker_pool

    monkeypatch.setenv(worker_pool.USER_CODE_RESOURCE_ENV, "opd_user_code_absent")
    monkeypatch.setattr(worker_pool, "START_TIMEOUT_S", 8.0)
    pool = RolloutPool("job", _component("functions.procs.Echo"), workspace)
    with pytest.raises(ProcessorLoadError) as raised:
        asyncio.run(pool.start())
    assert "Ray resource opd_user_code_absent (OPD_USER_CODE_RESOURCE)" in str(raised.value)
