"""Metering: the usage a job's parts report, added up per role and over a job's runs; records' deltas add
up to the total; budgets name the limit reached; a process tree's CPU-seconds include its children."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from opd_trainer.cluster import process_usage
from opd_trainer.cluster.process_usage import process_tree_cpu_seconds
from opd_trainer.driver.metering import RECORDED, Meter, budget_reached, usage_summary
from opd_trainer.jobspec.job_spec import Budget


class _Part:
    """An engine group, learner or pool: answers `usage()` with what it was told it used."""

    def __init__(self, **usage: float) -> None:
        self.numbers = usage

    async def usage(self) -> dict[str, float]:
        return dict(self.numbers)


class _Gateway:
    def __init__(self, cpu_s: float) -> None:
        self.usage = SimpleNamespace(remote=lambda: _ready({"cpu_s": cpu_s, "gpus": 0.0}))


async def _ready(value: Any) -> Any:
    return value


def _engine(prompt: float, generated: float, hits: float, cpu_s: float, gpus: float = 0.0) -> _Part:
    return _Part(
        prompt_tokens=prompt, generation_tokens=generated, prefix_cache_hits=hits, cpu_s=cpu_s, gpus=gpus
    )


def _components(teacher_prompt: float, learner_gpus: float = 0.0) -> Any:
    return SimpleNamespace(
        student=_engine(100, 40, 0, 3.0),
        teachers=_engine(teacher_prompt, 10, 30, 2.0),
        learner=_Part(cpu_s=5.0, gpus=learner_gpus),
        gateways=(_Gateway(1.0), _Gateway(0.5)),
        pools=(_Part(calls=8, call_seconds=1.5, cpu_s=0.25), _Part(calls=4, call_seconds=0.5, cpu_s=0.25)),
    )


def test_usage_adds_up_every_part_per_role() -> None:
    meter = Meter()
    meter.add_step({"forwarded_tokens": 140.0, "trained_tokens": 40.0})
    usage = asyncio.run(meter.read(_components(teacher_prompt=140)))
    assert usage["teacher_tokens"] == 150 and usage["teacher_cached_tokens"] == 30
    assert usage["student_prompt_tokens"] == 100 and usage["student_generated_tokens"] == 40
    assert usage["learner_tokens_forwarded"] == 140 and usage["learner_tokens_trained"] == 40
    assert usage["processor_calls"] == 12 and usage["processor_seconds"] == 2.0
    assert usage["cpu_s/student_engines"] == 3.0 and usage["cpu_s/teacher_engines"] == 2.0
    assert usage["cpu_s/learner"] == 5.0 and usage["cpu_s/gateways"] == 1.5
    assert usage["cpu_s/processors"] == 0.5 and usage["cpu_s/driver"] > 0
    roles = [k for k in usage if k.startswith("cpu_s/")]
    assert usage["cpu_s"] == pytest.approx(sum(usage[k] for k in roles))
    assert usage["gpu_s"] == 0.0 and usage["wall_s"] >= 0


def test_gpu_seconds_are_gpus_held_times_the_seconds_held() -> None:
    meter = Meter()
    time.sleep(0.2)  # start-up: the GPUs the first read finds were held since the meter started
    first = asyncio.run(meter.read(_components(teacher_prompt=0, learner_gpus=2.0)))
    assert 0.4 <= first["gpu_s/learner"] < 1.0
    time.sleep(0.2)
    usage = asyncio.run(meter.read(_components(teacher_prompt=0, learner_gpus=2.0)))
    assert 0.8 <= usage["gpu_s/learner"] < 2.0 and usage["gpu_s"] == usage["gpu_s/learner"]


def test_record_deltas_add_up_to_the_usage_and_a_resume_starts_from_the_earlier_runs() -> None:
    earlier = {"teacher_tokens": 1000.0, "wall_s": 50.0, "cpu_s": 10.0}
    meter = Meter(earlier)
    deltas = []
    final: dict[str, float] = {}
    for teacher_prompt in (100, 250, 600):
        final = asyncio.run(meter.read(_components(teacher_prompt)))
        deltas.append(meter.deltas(final))
    assert final["teacher_tokens"] == 1000 + 610
    for key in RECORDED:  # what this run used: its records add up to it
        assert sum(d[f"usage/{key}"] for d in deltas) == pytest.approx(final[key] - earlier.get(key, 0.0))
    assert [d["usage/teacher_tokens"] for d in deltas] == [110, 150, 350]


def test_a_budget_names_the_first_limit_reached() -> None:
    usage = {"teacher_tokens": 5000.0, "cpu_s": 30.0, "gpu_s": 0.0, "wall_s": 12.0}
    assert budget_reached(Budget(), usage) is None
    assert budget_reached(Budget(max_teacher_tokens=6000, max_wall_seconds=60), usage) is None
    reached = budget_reached(Budget(max_teacher_tokens=5000), usage)
    assert reached is not None and reached.startswith("budget.max_teacher_tokens reached")
    reached = budget_reached(Budget(max_cpu_seconds=100, max_wall_seconds=10), usage)
    assert reached is not None and "max_wall_seconds" in reached and "wall_s 12" in reached
    assert "teacher tokens 5000" in usage_summary(usage)


def test_budget_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_teacher_tokens"):
        Budget(max_teacher_tokens=0)
    with pytest.raises(ValueError, match="max_gpu_seconds"):
        Budget(max_gpu_seconds=-1)


def test_a_process_tree_counts_its_children_cpu() -> None:
    burn = (
        "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        deadline = time.monotonic() + 20
        while process_tree_cpu_seconds(child.pid) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_tree_cpu_seconds(child.pid) >= 0.6
        own = psutil.Process().cpu_times()
        assert process_tree_cpu_seconds() - (own.user + own.system) >= 0.6  # the tree holds the busy child
    finally:
        child.kill()
        child.wait()
    assert process_tree_cpu_seconds(child.pid) == 0.0  # gone


@pytest.mark.parametrize("children_files", [True, False])
def test_descendants_walks_down_from_the_root_as_psutil_scans(
    monkeypatch: pytest.MonkeyPatch, children_files: bool
) -> None:
    """Both ways of listing a tree (each task's `children` file; psutil's scan of every process where
    the kernel has no such files) find the same grandchildren, started from a thread of the child."""
    if children_files and not process_usage._CHILDREN_FILES:
        pytest.skip("this kernel lists no task's children")
    monkeypatch.setattr(process_usage, "_CHILDREN_FILES", children_files)
    spawn = (
        "import subprocess, sys, threading, time\n"
        "def start(): subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "start()\n"
        "helper = threading.Thread(target=start); helper.start(); helper.join()\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", spawn], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        root = psutil.Process(child.pid)
        found = process_usage.descendants(psutil.Process())
        expected = {child.pid, *(p.pid for p in root.children(recursive=True))}
        assert len(expected) == 3  # the child and its two grandchildren
        assert expected <= {p.pid for p in found}
        assert {p.pid for p in process_usage.descendants(root)} == expected - {child.pid}
    finally:
        for process in psutil.Process(child.pid).children(recursive=True):
            process.kill()
        child.kill()
        child.wait()
