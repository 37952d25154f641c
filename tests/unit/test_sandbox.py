"""The sandbox's pieces without Ray: its command line, environment, limits and JSON channel."""

from __future__ import annotations

import ast
import asyncio
import os
import shutil
import textwrap
from pathlib import Path

import pytest

from opd_trainer.errors import ProcessorLoadError
from opd_trainer.sdk import ModelResource, RolloutInput, RolloutOutput, TaskStatus
from opd_trainer.storage.zips import pack_workspace
from opd_trainer.workers import sandbox
from opd_trainer.workers.process_limits import ProcessLimits, _parse
from opd_trainer.workers.processor_channel import SandboxedProcessor

PROCESSORS = """
import os

from opd_trainer.sdk import AbstractRolloutProcessor, AgentOutput, RolloutOutput

MARKER = os.environ.get("MARKER_FILE", "/nonexistent")


class Gadget:
    def __reduce__(self):  # what a pickle-based channel would run in the trusted process
        return (open, (MARKER, "w"))


class ReturnsGadget(AbstractRolloutProcessor):
    async def process(self, rollout_input):
        output = RolloutOutput(agent_output=AgentOutput(messages=[{"role": "assistant", "content": "x"}]))
        output.agent_output.rollout_extra["gadget"] = Gadget()
        return output


class ReturnsGarbage(AbstractRolloutProcessor):
    async def process(self, rollout_input):
        return {"status": "SUCCESS", "agent_output": {"messages": "not a list"}}


class ReadsEnvironment(AbstractRolloutProcessor):
    async def process(self, rollout_input):
        names = sorted(os.environ)
        reply = {"role": "assistant", "content": repr(names)}
        return RolloutOutput(agent_output=AgentOutput(messages=[reply]))


class BrokenSetup(AbstractRolloutProcessor):
    def setup(self):
        raise ValueError("no config file")

    async def process(self, rollout_input):
        return None
"""


def _processor(tmp_path: Path, class_name: str, mode: str, **env: str) -> SandboxedProcessor:
    workspace = tmp_path / "workspace"
    workspace.mkdir(exist_ok=True)
    (workspace / "procs.py").write_text(textwrap.dedent(PROCESSORS))
    return SandboxedProcessor(
        workspace_zip=pack_workspace(workspace),
        classpath=f"procs.py:{class_name}",
        kind="rollout",
        component="c",
        concurrency=2,
        timeout_s=20,
        answer_grace_s=5,
        memory_mb=1024,
        scratch_mb=64,
        cpus=1,
        runtime_env=env,
        requirements=[],
        mode=mode,
        network="gateway",
    )


def _payload() -> RolloutInput:
    resource = ModelResource(model_name="m", base_url="http://127.0.0.1:9/v1", api_key="rollout-key")
    return RolloutInput(messages=[{"role": "user", "content": "hi"}], model_resource=resource)


async def _one_call(processor: SandboxedProcessor) -> dict:
    await processor.start()
    try:
        return await processor.call(_payload(), "r1", RolloutOutput)
    finally:
        await processor.close()


MODES = [
    "none",
    pytest.param("bwrap", marks=pytest.mark.skipif(sandbox.bwrap_problem() is not None, reason="no bwrap")),
]


@pytest.mark.parametrize("mode", MODES)
def test_a_returned_pickle_gadget_is_only_text_to_the_worker(tmp_path: Path, mode: str) -> None:
    marker = tmp_path / "gadget-ran"
    result = asyncio.run(_one_call(_processor(tmp_path, "ReturnsGadget", mode, MARKER_FILE=str(marker))))
    output = result["output"]  # not JSON: the call fails in the sandbox, and nothing runs out here
    assert output.status == TaskStatus.FAILED and "PydanticSerializationError" in output.error, output
    assert not marker.exists()


@pytest.mark.parametrize("mode", MODES)
def test_an_invalid_answer_fails_the_call_naming_the_component(tmp_path: Path, mode: str) -> None:
    result = asyncio.run(_one_call(_processor(tmp_path, "ReturnsGarbage", mode)))
    assert result["output"].status == TaskStatus.FAILED
    assert result["output"].error.startswith("c: ")


@pytest.mark.parametrize("mode", MODES)
def test_the_processor_sees_only_the_allowlist_and_its_runtime_env(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPD_ADMIN_KEY", "secret-of-the-server")
    monkeypatch.setenv("DATABASE_URL", "postgresql://secret")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    result = asyncio.run(_one_call(_processor(tmp_path, "ReadsEnvironment", mode, MY_SETTING="1")))
    names = ast.literal_eval(result["output"].agent_output.messages[0]["content"])
    assert "MY_SETTING" in names and sandbox.SANDBOXED_ENV in names
    assert not {"OPD_ADMIN_KEY", "DATABASE_URL", "RAY_ADDRESS", "LD_PRELOAD"} & set(names)


def test_a_setup_error_is_a_load_error_with_the_users_message(tmp_path: Path) -> None:
    with pytest.raises(ProcessorLoadError) as raised:
        asyncio.run(_one_call(_processor(tmp_path, "BrokenSetup", "none")))
    assert "no config file" in str(raised.value) and raised.value.field == "functions.c.fcmodel"


def test_the_bwrap_command_unshares_and_binds_no_data(tmp_path: Path) -> None:
    layout = sandbox.SandboxLayout(control_dir=tmp_path, deps_dir=None, scratch_mb=32, network="gateway")
    command = sandbox.bwrap_command(layout, {"A": "1"}, ["python", "-m", "x"])
    for option in ("--unshare-pid", "--unshare-ipc", "--unshare-net", "--clearenv", "--die-with-parent"):
        assert option in command
    assert ["--ro-bind", str(tmp_path), sandbox.CONTROL_DIR] == command[
        command.index(str(tmp_path)) - 1 : command.index(str(tmp_path)) + 2
    ]
    assert "/tmp/ray" not in command and command[-3:] == ["python", "-m", "x"]
    host = sandbox.bwrap_command(
        sandbox.SandboxLayout(control_dir=tmp_path, deps_dir=None, scratch_mb=32, network="host"), {}, ["x"]
    )
    assert "--unshare-net" not in host


def test_the_environment_inherits_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPD_ADMIN_KEY", "secret")
    runtime_env = {"LANG": "de_DE.UTF-8", "LD_PRELOAD": "/tmp/x.so", "PYTHONPATH": "/tmp"}
    env = sandbox.sandbox_environment(runtime_env, mode="bwrap", cpus=2, has_deps=False)
    assert "OPD_ADMIN_KEY" not in env and env["LANG"] == "de_DE.UTF-8" and env["OMP_NUM_THREADS"] == "2"
    assert "LD_PRELOAD" not in env and env.get("PYTHONPATH") != "/tmp"
    # The only PYTHONPATH is the sandbox's own: where this service's bound packages are, if outside
    # the installation.
    assert env.get("PYTHONPATH", "").split(os.pathsep) == (sandbox.package_roots() or [""])


def test_the_packages_are_found_where_the_worker_found_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A worker importing this service from a source tree (PYTHONPATH) gives the sandbox that tree;
    packages inside the interpreter's installation add nothing."""
    tree = tmp_path / "checkout"
    found = [tree / name for name in sandbox.PACKAGES]
    monkeypatch.setattr(sandbox, "_package_dirs", lambda: found)
    assert sandbox.package_roots() == [str(tree)]
    env = sandbox.sandbox_environment({}, mode="bwrap", cpus=1, has_deps=False)
    assert env["PYTHONPATH"] == str(tree)
    site = Path(sandbox.python_dirs()[0]).resolve() / "lib" / "site-packages"
    monkeypatch.setattr(sandbox, "_package_dirs", lambda: [site / name for name in sandbox.PACKAGES])
    assert sandbox.package_roots() == []
    assert "PYTHONPATH" not in sandbox.sandbox_environment({}, mode="bwrap", cpus=1, has_deps=False)


def test_the_launcher_reads_its_options_and_command() -> None:
    limits = ProcessLimits(memory_mb=256, max_processes=64, mechanism="rlimits")
    argv = limits.launcher_argv(uid=65534)
    options, command = _parse([*argv[4:], "--", "bwrap", "--", "python"])
    assert options["--memory-mb"] == ["256"] and options["--uid"] == ["65534"] and "--rlimits" in options
    assert command == ["bwrap", "--", "python"]


def test_a_server_refuses_user_code_where_bwrap_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: "bwrap is not installed")
    with pytest.raises(sandbox.SandboxUnavailable):
        sandbox.effective_mode("auto", server=True)
    with pytest.raises(sandbox.SandboxUnavailable):
        sandbox.effective_mode("bwrap", server=False)
    assert sandbox.effective_mode("auto", server=False) == "none"  # opd train: one's own code
    assert sandbox.effective_mode("none", server=True) == "none"  # the operator's explicit choice


def test_what_a_killed_worker_left_is_removed_by_the_next_one(tmp_path: Path) -> None:
    import subprocess
    import tempfile

    from opd_trainer.workers.processor_channel import remove_stale_control_dirs

    exited = subprocess.Popen(["true"])  # a worker that is gone: its pid names no process
    exited.wait()
    stale = Path(tempfile.mkdtemp(prefix=f"opd-sandbox-{exited.pid}-"))
    (stale / "workspace.zip").write_bytes(b"left behind")
    live = Path(tempfile.mkdtemp(prefix=f"opd-sandbox-{os.getpid()}-"))
    try:
        remove_stale_control_dirs()
        assert not stale.exists() and live.exists()
    finally:
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


def test_a_call_to_a_sandbox_whose_pipe_just_closed_fails_as_retryable(tmp_path: Path) -> None:
    """The process can exit between the last check and the write of a call (CI saw uvloop raise
    RuntimeError there): the call never reached it, so it fails as one another worker may take."""

    async def body() -> dict:
        processor = _processor(tmp_path, "ReadsEnvironment", "none")
        await processor.start()
        try:
            assert processor._process is not None and processor._process.stdin is not None
            processor._process.stdin.close()  # as the transport is when the process is gone
            await asyncio.sleep(0.5)
            processor.lost = None  # the window: its reader has not yet seen the process exit
            return await processor.call(_payload(), "r1", RolloutOutput)
        finally:
            await processor.close()

    uvloop = pytest.importorskip("uvloop")  # Ray runs async actors on uvloop, whose write raises here
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        result = runner.run(body())
    assert result["output"].status == TaskStatus.FAILED and result["retry"] is True, result


def test_a_call_cancelled_while_its_payload_is_prepared_leaves_nothing_pending(tmp_path: Path) -> None:
    """A cancel can come while the call waits for its gateway's relay (`_wire_payload`): the call is
    no longer counted in flight (the worker's `stats`)."""
    processor = _processor(tmp_path, "ReadsEnvironment", "none")

    async def relay_never_opens(payload: RolloutInput) -> dict:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    processor._wire_payload = relay_never_opens  # type: ignore[method-assign]

    async def body() -> None:
        call = asyncio.ensure_future(processor.call(_payload(), "r1", RolloutOutput))
        await asyncio.sleep(0.05)
        assert len(processor._pending) == 1
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert processor._pending == {}

    asyncio.run(body())
