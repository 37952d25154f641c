"""The paired bootstrap over episodes x seeds (`benchmarks/paired_bootstrap.py`)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from paired_bootstrap import Pair, paired_difference, pairs_of


def _binary(arm: list[int], base: list[int]) -> list[Pair]:
    return [Pair(a, 1.0, b, 1.0) for a, b in zip(arm, base, strict=True)]


def _noisy(seed: int, n: int, arm_rate: float, base_rate: float) -> list[Pair]:
    rng = random.Random(seed)
    return _binary(
        [int(rng.random() < arm_rate) for _ in range(n)], [int(rng.random() < base_rate) for _ in range(n)]
    )


def test_identical_differences_give_a_point_interval() -> None:
    found = paired_difference({0: _binary([1, 1, 0, 1], [0, 1, 0, 0]), 1: _binary([1, 0], [0, 0])})
    # (3 + 1) / 6 - 1 / 6 over all episodes of both seeds.
    assert found.estimate == pytest.approx(0.5) and (found.seeds, found.episodes) == (2, 6)
    every = paired_difference({0: _binary([1] * 5, [0] * 5), 3: _binary([1] * 7, [0] * 7)})
    assert (every.estimate, every.low, every.high, every.half_width) == (1.0, 1.0, 1.0, 0.0)


def test_a_clear_gain_excludes_zero_and_no_gain_includes_it() -> None:
    gain = paired_difference({s: _noisy(s, 300, 0.6, 0.3) for s in range(3)})
    assert gain.low is not None and gain.low > 0 and gain.excludes_zero
    assert gain.low < gain.estimate < gain.high  # type: ignore[operator]
    none = paired_difference({s: _noisy(10 + s, 300, 0.4, 0.4) for s in range(3)})
    assert none.low < 0 < none.high and not none.excludes_zero  # type: ignore[operator]
    # More episodes, a narrower interval.
    wider = paired_difference({s: _noisy(10 + s, 30, 0.4, 0.4) for s in range(3)})
    assert wider.half_width > none.half_width  # type: ignore[operator]


def test_the_interval_is_deterministic_in_its_rng_seed() -> None:
    data = {s: _noisy(s, 100, 0.5, 0.45) for s in range(4)}
    assert paired_difference(data) == paired_difference(data)
    assert paired_difference(data, rng_seed=1) != paired_difference(data)
    assert paired_difference(data, resamples=500).resamples == 500


def test_seeds_that_disagree_widen_the_interval_beyond_episodes_alone() -> None:
    """Resampling seeds carries seed-to-seed variation: two seeds with opposite gains give an interval
    that includes 0, though each seed's own gain is clear."""
    split = {0: _noisy(0, 400, 0.8, 0.2), 1: _noisy(1, 400, 0.2, 0.8)}
    found = paired_difference(split)
    assert found.low < 0 < found.high  # type: ignore[operator]
    assert paired_difference({0: split[0]}).low > 0.4  # type: ignore[operator]


def test_a_rate_over_turns_pools_numerators_and_denominators() -> None:
    # Arm: 3 of 4 turns then 1 of 1; base: 1 of 2 then 0 of 1: 4/5 - 1/3.
    pairs = [Pair(3, 4, 1, 2), Pair(1, 1, 0, 1)]
    assert paired_difference({0: pairs}).estimate == pytest.approx(4 / 5 - 1 / 3)
    assert paired_difference({}).estimate is None and paired_difference({0: []}).seeds == 0


def test_outcomes_pair_by_sample_id() -> None:
    arm = [{"sample_id": "a", "success": True, "turns": 3, "ok": 2}, {"sample_id": "b", "success": False}]
    base = [{"sample_id": "b", "success": True}, {"sample_id": "a", "success": False, "turns": 2, "ok": 2}]
    assert pairs_of(arm, base, "success") == [Pair(1, 1, 0, 1, key="a"), Pair(0, 1, 1, 1, key="b")]
    assert pairs_of(arm[:1], base, "ok", "turns") == [Pair(2, 3, 2, 2, key="a")]
    assert pairs_of(arm, base[:1], "success") == [Pair(0, 1, 1, 1, key="b")]  # only the episodes both have
    assert [p.key for p in pairs_of(arm[::-1], base, "success")] == ["a", "b"]  # in sample_id order


def test_seeds_that_ran_the_same_episodes_share_each_resamples_episode_draw() -> None:
    # The same episode gains on every seed: drawn independently per seed the seeds would look like
    # independent evidence; drawn once per resample the interval is as wide as one seed's.
    rng = random.Random(7)
    gains = [int(rng.random() < 0.3) for _ in range(60)]
    keyed = [Pair(g, 1.0, 0.0, 1.0, key=f"e{i:03d}") for i, g in enumerate(gains)]
    unkeyed = [Pair(g, 1.0, 0.0, 1.0) for g in gains]
    crossed = paired_difference({s: keyed for s in range(5)})
    independent = paired_difference({s: unkeyed for s in range(5)})
    one_seed = paired_difference({0: keyed})
    assert crossed.estimate == independent.estimate == one_seed.estimate
    assert crossed.half_width == pytest.approx(one_seed.half_width, rel=0.25)  # type: ignore[arg-type]
    assert independent.half_width < 0.7 * crossed.half_width  # type: ignore[operator]
