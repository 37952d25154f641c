"""benchmarks/efficacy.py's RL learning-rate sweep (issue 31: the baseline at its best setting): the
`rl@<lr>` arms' specs, and the step ratio taken against the best RL arm, not the one at OPD's rate."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import efficacy


def _arm(end: float, steps_90: float | None) -> dict[str, object]:
    return {"end": end, "steps_to_90": steps_90, "seeds_reaching_90": "3/3" if steps_90 else "0/3"}


def test_the_rl_baseline_is_compared_at_its_best_learning_rate() -> None:
    arms = {
        "opd": _arm(0.80, 10.0),
        "rl": _arm(0.30, None),  # at OPD's learning rate it diverges
        efficacy.rl_lr_arm(5e-5): _arm(0.55, 30.0),
        efficacy.rl_lr_arm(1e-5): _arm(0.40, None),
    }
    assert efficacy.rl_lr_arm(5e-5) == "rl@5e-05" and efficacy.best_rl_arm(arms) == "rl@5e-05"
    line = efficacy.step_ratio(arms, 40, 0.9)
    assert "3.0x fewer steps than RL (rl@5e-05" in line
    assert efficacy.best_rl_arm({"opd": _arm(0.8, 10.0)}) is None


def test_an_rl_lr_arm_is_the_rl_arm_at_that_learning_rate() -> None:
    spec = efficacy.arm_spec(efficacy.rl_lr_arm(2e-5), seed=1, steps=4, eval_steps=2)
    plain = efficacy.arm_spec("rl", seed=1, steps=4, eval_steps=2)
    assert spec.hyper_parameters.learning_rate == 2e-5
    assert spec.hyper_parameters.kl_coef == plain.hyper_parameters.kl_coef == 0.0
    assert [f.name for f in spec.functions] == [f.name for f in plain.functions]


def test_the_published_step_ratio_reads_the_best_rl_arm() -> None:
    import repeat

    record = {
        "settings": {"steps": 40},
        "headline_opd_arm": "opd",
        "best_rl_arm": "rl@5e-05",
        "runs": {
            "opd": [_seed([(0, 0.3), (4, 0.65)])],
            "rl": [_seed([(0, 0.3)])],  # at OPD's rate: never (the budget, 40)
            "rl@5e-05": [_seed([(0, 0.3), (20, 0.65)])],
        },
    }
    assert repeat.figures_of("efficacy", [record])["steps_to_50_ratio"] == [20 / 4]


def test_the_rl_arms_train_for_their_own_longer_budget() -> None:
    assert efficacy.arm_steps("rl", 40, 120) == 120
    assert efficacy.arm_steps(efficacy.rl_lr_arm(5e-5), 40, 120) == 120
    assert efficacy.arm_steps("opd", 40, 120) == 40
    assert efficacy.arm_steps(efficacy.estimator_arm("sampled"), 40, 120) == 40
    assert efficacy.arm_steps("opd+rl", 40, 120) == 40  # not reward-only: OPD's budget
    assert efficacy.arm_steps("rl", 40, None) == 40
    table = efficacy.format_table(
        {"opd": {**_full_arm(), "steps_to_90": 8.0}, "rl": _full_arm()}, steps=40, rl_steps=120
    )
    opd_row, rl_row = table.splitlines()[2:]
    assert ">40" in opd_row and ">120" not in opd_row  # each arm not arriving shows its own budget
    assert ">120" in rl_row and ">40" not in rl_row


def test_an_rl_that_never_arrives_counts_as_its_own_budget() -> None:
    import repeat

    record = {
        "settings": {"steps": 40, "rl_steps": 120},
        "headline_opd_arm": "opd",
        "best_rl_arm": "rl",
        "runs": {"opd": [_seed([(0, 0.3), (4, 0.65)])], "rl": [_seed([(0, 0.3), (120, 0.4)])]},
    }
    assert repeat.figures_of("efficacy", [record])["steps_to_50_ratio"] == [120 / 4]
    assert efficacy.step_ratio(
        {"opd": {**_full_arm(), "steps_to_50": 4.0}, "rl": _full_arm()}, 120, 0.5
    ).startswith("50% of the gap: RL did not reach it in 120 steps, OPD needs > 30.0x fewer")


def _seed(curve: list[tuple[int, float]]) -> dict[str, object]:
    """One seed's run as `summarize_seed` records it: start 0.3, teacher 0.9, the given validations."""
    return {
        "start": 0.3,
        "end": curve[-1][1],
        "teacher": 0.9,
        "curve": [{"step": s, "exact_match": em, "train_s": 10.0 * s} for s, em in curve],
    }


def _full_arm() -> dict[str, object]:
    """An arm's summary as `summarize_arm` makes it, reaching no level of the gap."""
    return {
        "start": 0.3,
        "end": 0.35,
        "end_std": 0.0,
        "teacher": 0.9,
        "gap_closed": 0.08,
        "steps_to_50": None,
        "steps_to_90": None,
        "seeds_reaching_50": "0/3",
        "seeds_reaching_90": "0/3",
        "train_s_to_90": None,
    }
