"""Paired bootstrap over episodes x seeds: the difference of a rate between an arm and its base run,
with a percentile interval (the self-correction study's headline, issue 54).

Each seed ran the arm and the base on the same validation episodes, so each episode gives a pair. A
rate is a ratio of sums over episodes (`num / den`): task success has `den = 1` per episode (a mean);
turn success has an episode's turns as `den` and its successful turns as `num`, so the pooled value is
what validation reports (`agent/turn_success` is over turns, not episodes). The statistic is

    diff = sum(arm_num) / sum(arm_den) - sum(base_num) / sum(base_den)

over every (seed, episode). One resample draws the seeds with replacement, then episodes with
replacement (both arms together: the pairing is kept), and recomputes `diff`. Where every seed ran the
same episodes (the study validates each seed on one generated set: the pairs carry the episode's `key`,
and the keys agree), one draw of episodes serves every seed of a resample (a crossed bootstrap: an
episode that always gains counts as one episode, not as one per seed, so the interval is not narrowed by
treating the seeds' shared episodes as independent); otherwise each drawn seed's episodes are drawn on
their own. The interval is the `level` percentile interval of `resamples` such draws from a fixed RNG
seed, so the same data always gives the same interval. With one seed only episodes vary (the interval
then says nothing of seed-to-seed variation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
RNG_SEED = 0


@dataclass(frozen=True)
class Pair:
    """One episode's rate parts in the arm and in the base (`den` 1 for a per-episode 0/1 outcome)."""

    arm_num: float
    arm_den: float
    base_num: float
    base_den: float
    key: str = ""
    """The episode (its sample_id): seeds whose pairs have the same keys in the same order ran the same
    episodes."""


@dataclass(frozen=True)
class Interval:
    """`estimate` on all the data, the percentile interval [`low`, `high`], its `half_width` (the
    difference the study can resolve), and how many seeds, episodes (over all seeds) and resamples."""

    estimate: float | None
    low: float | None
    high: float | None
    half_width: float | None
    seeds: int
    episodes: int
    resamples: int

    @property
    def excludes_zero(self) -> bool:
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def paired_difference(
    pairs_by_seed: Mapping[int, Sequence[Pair]],
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    rng_seed: int = RNG_SEED,
) -> Interval:
    """The arm's rate minus the base's over every seed's episodes, with its bootstrap interval (module
    docstring). Seeds without episodes are left out; with none left every value is None."""
    parts = {
        seed: np.array([[p.arm_num, p.arm_den, p.base_num, p.base_den] for p in pairs], dtype=float)
        for seed, pairs in pairs_by_seed.items()
        if pairs
    }
    episodes = sum(len(p) for p in parts.values())
    if not parts:
        return Interval(None, None, None, None, 0, 0, resamples)
    pooled = np.concatenate(list(parts.values())).sum(axis=0)
    estimate = _ratio(pooled[0:1], pooled[1:2])[0] - _ratio(pooled[2:3], pooled[3:4])[0]
    rng = np.random.default_rng(rng_seed)
    seeds = list(parts)
    drawn = rng.integers(0, len(seeds), size=(resamples, len(seeds)))  # seeds, with replacement
    keys = {tuple(p.key for p in pairs_by_seed[seed]) for seed in seeds}
    crossed = len(keys) == 1 and all(next(iter(keys)))
    shared = (
        rng.integers(0, len(parts[seeds[0]]), size=(resamples, len(parts[seeds[0]]))) if crossed else None
    )
    sums = np.zeros((resamples, 4))
    for slot in range(len(seeds)):
        for index, seed in enumerate(seeds):
            rows = np.flatnonzero(drawn[:, slot] == index)  # resamples whose slot drew this seed
            if rows.size == 0:
                continue
            data = parts[seed]
            # Its episodes, with replacement: the resample's one draw when the seeds share episodes.
            picks = (
                shared[rows]
                if shared is not None
                else rng.integers(0, len(data), size=(rows.size, len(data)))
            )
            sums[rows] += data[picks].sum(axis=1)
    stats = _ratio(sums[:, 0], sums[:, 1]) - _ratio(sums[:, 2], sums[:, 3])
    stats = stats[~np.isnan(stats)]
    if not np.isfinite(estimate) or stats.size == 0:
        return Interval(None, None, None, None, len(seeds), episodes, resamples)
    low, high = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return Interval(
        float(estimate), float(low), float(high), float(high - low) / 2, len(seeds), episodes, resamples
    )


def pairs_of(
    arm: Sequence[Mapping[str, Any]], base: Sequence[Mapping[str, Any]], num: str, den: str | None = None
) -> list[Pair]:
    """Pairs of two runs' per-episode outcomes (`driver/validation.validation_outcomes`), matched by
    `sample_id` (episodes only one run has are left out): `num` the numerator's key (a bool counts 0/1),
    `den` the denominator's (None: 1 per episode)."""
    by_id = {o["sample_id"]: o for o in base}

    def parts(o: Mapping[str, Any]) -> tuple[float, float]:
        return float(o[num] or 0), 1.0 if den is None else float(o[den] or 0)

    matched = sorted((o for o in arm if o["sample_id"] in by_id), key=lambda o: str(o["sample_id"]))
    return [Pair(*parts(o), *parts(by_id[o["sample_id"]]), key=str(o["sample_id"])) for o in matched]
