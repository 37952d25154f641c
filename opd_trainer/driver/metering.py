"""Metering and budgets: what a job used, read from the parts that used it.

`Meter.read` returns the job's usage so far, cumulative over every run of the job (a resumed job
starts from what the run directory's `usage.json` says the earlier runs used):

- `teacher_tokens`: prompt and generated tokens of every teacher request (scoring the student's
  tokens is a prompt pass over prompt + completion; the validation baseline generates), read from the
  teacher engines' own counters; `teacher_cached_tokens` of them were prefix-cache hits.
- `student_prompt_tokens`, `student_generated_tokens`: the same of the student engines (rollouts,
  validation, the drift probe).
- `learner_tokens_forwarded`, `learner_tokens_trained`: prompt + completion and completion tokens of
  the segments the learner trained on, from the steps' metrics.
- `processor_calls`, `processor_seconds`: calls of the user's rollout / reward / evaluator processors
  and the seconds they took (failed ones too).
- `wall_s`: seconds the job's driver ran; `cpu_s` and `gpu_s`, with one `cpu_s/ROLE` and `gpu_s/ROLE`
  per role (`student_engines`, `teacher_engines`, `learner`, `gateways`, `processors`, `driver`): the
  CPU-seconds of each role's processes (`cluster/process_usage.py`) and the GPUs each holds times the
  seconds it held them. The gateways run in the student engine's process
  (`rollout/gateway_placement.py`): `gateways` is 0 and their CPU is the student engines', unless the
  job's student is shared with other jobs (then they run in a process of their own, `gateways`).
  A LoRA job whose teacher is its student's base model has no teacher engine: `teacher_engines` and
  `student_engines` are the two roles' shares of the student's engines (`ClientEngineGroup`: each
  role's own requests' tokens, the CPU/GPU split by tokens), so neither counts the other's.

Each training and validation record carries `usage/KEY`: what the job used since the record before it,
so the records of a run add up to its usage. `Budget` limits (`budget` in the job spec) are checked
against the usage after every step (`budget_reached`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from opd_trainer.cluster.process_usage import process_tree_cpu_seconds
from opd_trainer.jobspec.job_spec import Budget

if TYPE_CHECKING:  # the components' modules load torch and vLLM; `opd estimate --help` must not
    from opd_trainer.driver.components import Components

ROLES = ("student_engines", "teacher_engines", "learner", "gateways", "processors", "driver")
# The usage keys a record carries as deltas (the per-role split stays in the cumulative usage only).
RECORDED = (
    "teacher_tokens",
    "teacher_cached_tokens",
    "student_prompt_tokens",
    "student_generated_tokens",
    "learner_tokens_forwarded",
    "learner_tokens_trained",
    "processor_calls",
    "processor_seconds",
    "wall_s",
    "cpu_s",
    "gpu_s",
)


class Meter:
    """The job's usage (see the module docstring); `base`: what earlier runs of the job used."""

    def __init__(self, base: dict[str, float] | None = None) -> None:
        self.base = {k: float(v) for k, v in (base or {}).items() if isinstance(v, int | float)}
        self._started = time.monotonic()
        self._learner_tokens = {"learner_tokens_forwarded": 0.0, "learner_tokens_trained": 0.0}
        self._gpu_s = dict.fromkeys(ROLES, 0.0)  # this run's GPU-seconds per role
        self._gpus = dict.fromkeys(ROLES, 0.0)  # the GPUs each role held at the last read
        self._last_read = self._started
        self._recorded: dict[str, float] = {}  # the usage at the previous record (this run)
        self._driver_cpu_base = 0.0  # this process's CPU-seconds counted before this meter (a recovery)
        self._driver_cpu_read = 0.0  # this process's CPU-seconds at the last read

    def carried_over(self, usage: dict[str, float]) -> Meter:
        """A meter for the job's parts started again in this process (a recovery,
        `driver/recovery.py`), counting on from `usage`, the last read: the wall clock and this
        process's CPU continue from that read; what the lost parts used after it is not known."""
        meter = Meter(usage)
        meter._started = meter._last_read = self._last_read
        meter._driver_cpu_base = self._driver_cpu_read
        return meter

    def add_step(self, metrics: dict[str, float]) -> None:
        """A training step's learner tokens (its `forwarded_tokens`, `trained_tokens`)."""
        self._learner_tokens["learner_tokens_forwarded"] += metrics.get("forwarded_tokens", 0.0)
        self._learner_tokens["learner_tokens_trained"] += metrics.get("trained_tokens", 0.0)

    async def read(self, c: Components) -> dict[str, float]:
        """The usage so far, every part asked now (also what the records' deltas are taken from)."""
        student, teacher, learner, gateways, pools = await asyncio.gather(
            c.student.usage(),
            c.teachers.usage(),
            c.learner.usage(),
            asyncio.gather(*(gateway.usage.remote() for gateway in c.gateways)),
            asyncio.gather(*(pool.usage() for pool in c.pools)),
        )
        driver_cpu = process_tree_cpu_seconds()
        cpu = {
            "student_engines": student["cpu_s"],
            "teacher_engines": teacher["cpu_s"],
            "learner": learner["cpu_s"],
            "gateways": sum(g["cpu_s"] for g in gateways),
            "processors": sum(p["cpu_s"] for p in pools),
            "driver": driver_cpu - self._driver_cpu_base,
        }
        self._driver_cpu_read = driver_cpu
        gpus = {
            "student_engines": student["gpus"],
            "teacher_engines": teacher["gpus"],
            "learner": learner["gpus"],
            "gateways": sum(g["gpus"] for g in gateways),
        }
        now = time.monotonic()
        first = self._last_read == self._started
        for role in ROLES:  # GPUs held since the last read, at what was held then
            # Before the first read the parts were starting up, holding what they hold now.
            held = gpus.get(role, 0.0) if first else self._gpus[role]
            self._gpu_s[role] += held * (now - self._last_read)
            self._gpus[role] = gpus.get(role, 0.0)
        self._last_read = now
        run = {
            "teacher_tokens": teacher["prompt_tokens"] + teacher["generation_tokens"],
            "teacher_cached_tokens": teacher["prefix_cache_hits"],
            "student_prompt_tokens": student["prompt_tokens"],
            "student_generated_tokens": student["generation_tokens"],
            **self._learner_tokens,
            "processor_calls": sum(p["calls"] for p in pools),
            "processor_seconds": sum(p["call_seconds"] for p in pools),
            "wall_s": now - self._started,
            "cpu_s": sum(cpu.values()),
            "gpu_s": sum(self._gpu_s.values()),
            **{f"cpu_s/{role}": value for role, value in cpu.items()},
            **{f"gpu_s/{role}": value for role, value in self._gpu_s.items()},
        }
        return {key: self.base.get(key, 0.0) + value for key, value in run.items()}

    def deltas(self, usage: dict[str, float]) -> dict[str, float]:
        """`usage/KEY` since the previous record of this run (the first: since the run started)."""
        previous, self._recorded = self._recorded, usage
        return {f"usage/{k}": usage[k] - previous.get(k, self.base.get(k, 0.0)) for k in RECORDED}


def budget_reached(budget: Budget, usage: dict[str, float]) -> str | None:
    """The first limit of `budget` that `usage` reached, said in words; None when none is."""
    limits: list[tuple[str, float | None, str]] = [
        ("max_teacher_tokens", budget.max_teacher_tokens, "teacher_tokens"),
        ("max_cpu_seconds", budget.max_cpu_seconds, "cpu_s"),
        ("max_gpu_seconds", budget.max_gpu_seconds, "gpu_s"),
        ("max_wall_seconds", budget.max_wall_seconds, "wall_s"),
    ]
    for field, limit, key in limits:
        if limit is not None and usage.get(key, 0.0) >= limit:
            return f"budget.{field} reached: {key} {usage[key]:.6g} >= {limit:.6g}"
    return None


def usage_summary(usage: dict[str, float]) -> str:
    """One line for events and the terminal."""
    parts = [
        ("teacher tokens", "teacher_tokens", ""),
        ("student tokens generated", "student_generated_tokens", ""),
        ("tokens trained", "learner_tokens_trained", ""),
        ("CPU", "cpu_s", " s"),
        ("GPU", "gpu_s", " s"),
        ("wall", "wall_s", " s"),
    ]
    return ", ".join(f"{label} {usage.get(key, 0.0):.0f}{unit}" for label, key, unit in parts)
