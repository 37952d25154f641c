"""Turn-level hindsight advantages (signal/hindsight.py) and how the learner weighs them."""

from __future__ import annotations

import dataclasses

import torch
from learner_settings import SETTINGS
from turns import turn

from opd_trainer.learner.batch import row_advantages
from opd_trainer.signal.hindsight import hindsight_advantages
from opd_trainer.signal.pairs import diverging_turn


def test_single_turn_best_up_worst_down_middle_and_ties_untouched() -> None:
    segments = [
        turn([1, 2], [5], rollout=0, reward=1.0),
        turn([1, 2], [6], rollout=1, reward=0.0),
        turn([1, 2], [7], rollout=2, reward=0.5),
        # another prompt whose rollouts all ended alike: nothing to learn from hindsight
        turn([3], [5], rollout=3, reward=1.0, group=1),
        turn([3], [6], rollout=4, reward=1.0, group=1),
    ]
    assert hindsight_advantages(segments) == [1.0, -1.0, 0.0, 0.0, 0.0]


def test_only_the_turn_where_the_worse_trajectory_parted_is_marked() -> None:
    # Turn 0 identical (same call from the same context), turn 1 differs from the same context:
    # the wrong tool argument is the failure's cause, the last turns are not comparable.
    good = [
        turn([1], [10, 11], rollout=0, reward=1.0),
        turn([1, 10, 11, 90], [20], rollout=0, reward=1.0),
        turn([1, 10, 11, 90, 20, 91], [30], rollout=0, reward=1.0),
    ]
    bad = [
        turn([1], [10, 11], rollout=1, reward=0.0),
        turn([1, 10, 11, 90], [21], rollout=1, reward=0.0),
        turn([1, 10, 11, 90, 21, 92], [31], rollout=1, reward=0.0),
    ]
    assert diverging_turn(good, bad) == 1
    assert hindsight_advantages(good + bad) == [0.0, 1.0, 0.0, 0.0, -1.0, 0.0]


def test_no_signal_when_contexts_part_before_answers_or_one_trajectory_ends() -> None:
    # Same first call, but the tool answered differently: the second turns start from different contexts.
    tool_differs = [
        turn([1], [10], rollout=0, reward=1.0),
        turn([1, 10, 90], [20], rollout=0, reward=1.0),
        turn([1], [10], rollout=1, reward=0.0),
        turn([1, 10, 91], [21], rollout=1, reward=0.0),
    ]
    assert hindsight_advantages(tool_differs) == [0.0] * 4
    ended_early = [turn([1], [10], rollout=0, reward=1.0), turn([1], [10], rollout=1, reward=0.0)]
    ended_early.append(turn([1, 10, 90], [20], rollout=0, reward=1.0))
    assert hindsight_advantages(ended_early) == [0.0] * 3


def test_a_turn_in_several_pairs_gets_the_mean_of_its_signs() -> None:
    segments = [
        turn([1], [5], rollout=0, reward=1.0),
        turn([1], [5], rollout=1, reward=1.0),  # same answer as rollout 0
        turn([1], [6], rollout=2, reward=0.0),
        turn([1], [5], rollout=3, reward=0.0),  # the same answer as the best, yet failed later
    ]
    # Pairs: (0, 2) and (1, 2) diverge at turn 0; (0, 3) and (1, 3) never diverge (same single turn).
    assert hindsight_advantages(segments) == [1.0, 1.0, -1.0, 0.0]


def test_row_advantages_weigh_reward_and_hindsight() -> None:
    reward_B, hindsight_B = torch.tensor([0.5, -0.5]), torch.tensor([1.0, 0.0])
    both = dataclasses.replace(SETTINGS, reward_coef=2.0, hindsight_coef=0.25)
    torch.testing.assert_close(row_advantages(both, reward_B, hindsight_B), torch.tensor([1.25, -1.0]))
    only_hindsight = dataclasses.replace(SETTINGS, reward_coef=0.0, hindsight_coef=0.5)
    torch.testing.assert_close(
        row_advantages(only_hindsight, reward_B, hindsight_B), torch.tensor([0.5, 0.0])
    )
    assert row_advantages(dataclasses.replace(SETTINGS, reward_coef=0.0), reward_B, hindsight_B) is None
