"""A job's teachers: one engine group per teacher, and which teacher scores which sample.

A job names one teacher (`teacher_model: MODEL`, the teacher called `teacher`) or several
(`teacher_model: [{name, model, data_tags}]`, multi-teacher OPD). Each sample is scored by the
teacher whose `data_tags` list its data tag (`jobspec.dataset.data_tag_of`), else by the default
teacher (`JobSpec.teachers`), which also scores validation's teacher baseline and serves the
auxiliary `teacher` model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from opd_trainer.engine.engine_stats import combine
from opd_trainer.engine.vllm_engine import EngineGroup, TeacherScores
from opd_trainer.jobspec.dataset import Sample, data_tag_of
from opd_trainer.jobspec.job_spec import JobSpec

Pair = tuple[list[int], list[int]]
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Scored:
    """One pair's scores and the seconds its teacher's request took."""

    scores: TeacherScores
    teacher: str
    latency_s: float


@dataclasses.dataclass(frozen=True)
class TeacherEngines:
    """The engine group of every teacher, by name; `spec` routes samples to them."""

    spec: JobSpec
    groups: dict[str, EngineGroup]

    @property
    def default(self) -> EngineGroup:
        return self.groups[self.spec.teachers[0].name]

    @property
    def several(self) -> bool:
        return len(self.groups) > 1

    def name_for(self, sample: Sample) -> str:
        """The teacher that scores `sample`."""
        return self.spec.teacher_for_tag(data_tag_of(sample)) if self.several else next(iter(self.groups))

    async def _by_teacher(
        self,
        names: list[str],
        pairs: list[Pair],
        call: Callable[[EngineGroup, list[Pair]], Awaitable[list[T]]],
    ) -> list[tuple[T, str, float]]:
        """`call(group, its pairs)` for every teacher named in `names` (pair i goes to names[i]), in
        parallel; each result with its teacher and its request's seconds, in input order."""

        async def timed(name: str, chosen: list[int]) -> tuple[list[T], float]:
            started = time.perf_counter()
            result = await call(self.groups[name], [pairs[i] for i in chosen])
            return result, time.perf_counter() - started

        chosen = {name: [i for i, n in enumerate(names) if n == name] for name in dict.fromkeys(names)}
        parts = await asyncio.gather(*(timed(name, indices) for name, indices in chosen.items()))
        out: list[Any] = [None] * len(pairs)
        for (name, indices), (results, seconds) in zip(chosen.items(), parts, strict=True):
            for index, result in zip(indices, results, strict=True):
                out[index] = (result, name, seconds)
        return out

    async def score_top_k(self, names: list[str], pairs: list[Pair], top_k: int) -> list[Scored]:
        """Each pair scored by the teacher `names` gives it (with its `top_k` tokens per position)."""
        scored = await self._by_teacher(names, pairs, lambda group, part: group.score_top_k_many(part, top_k))
        return [Scored(scores, name, seconds) for scores, name, seconds in scored]

    async def score(self, names: list[str], pairs: list[Pair]) -> list[list[float]]:
        """Each pair's logprobs from the teacher `names` gives it."""
        scored = await self._by_teacher(names, pairs, lambda group, part: group.score_many(part))
        return [logprobs for logprobs, _, _ in scored]

    async def stats(self) -> dict[str, dict[str, float]]:
        """`engine/ROLE/KEY` numbers: `teacher` for all the teachers' engines together, and with several
        teachers `teacher.NAME` for each (`EngineGroup.stats` resets peaks: read once here)."""
        per_teacher = dict(
            zip(self.groups, await asyncio.gather(*(g.stats() for g in self.groups.values())), strict=True)
        )
        roles = {"teacher": combine(list(per_teacher.values()))}
        if self.several:
            roles.update({f"teacher.{name}": numbers for name, numbers in per_teacher.items()})
        return roles

    async def usage(self) -> dict[str, float]:
        """The teachers' engines' `EngineGroup.usage`, added up."""
        groups = await asyncio.gather(*(g.usage() for g in self.groups.values()))
        return {key: float(sum(g[key] for g in groups)) for key in groups[0]}
