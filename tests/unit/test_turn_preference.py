"""Turn-level preference pairs (signal/pairs.py): mining, conflict removal, the marks the learner reads,
and the DPO-style loss (learner/preference_loss.py); and how a step's signal and the job spec switch
them on."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from turns import turn

from opd_trainer.driver.step import minibatches
from opd_trainer.jobspec.job_spec import HyperParameters
from opd_trainer.learner.preference_loss import pair_sides, preference_loss
from opd_trainer.records import LLMCall
from opd_trainer.signal.pairs import mark_pairs, mine_preference_pairs, pairs_split_across
from opd_trainer.signal.shape import shape_signal


def test_single_turn_pairs_every_best_with_every_worst_and_drops_repeats() -> None:
    segments = [
        turn([1, 2], [5], rollout=0, reward=1.0),
        turn([1, 2], [5], rollout=1, reward=1.0),  # the same action as rollout 0
        turn([1, 2], [6], rollout=2, reward=0.0),
        turn([1, 2], [7], rollout=3, reward=0.5),  # neither best nor worst
        turn([3], [5], rollout=4, reward=1.0, group=1),  # a prompt whose rollouts ended alike
        turn([3], [6], rollout=5, reward=1.0, group=1),
    ]
    mined = mine_preference_pairs(segments)
    assert mined.pairs == [((0,), (2,))]
    assert (mined.duplicates, mined.conflicting, mined.skipped_context) == (1, 0, 0)


def test_a_multi_turn_pair_is_the_turn_where_the_runs_part() -> None:
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
    assert mine_preference_pairs(good + bad).pairs == [((1,), (4,))]


def test_runs_whose_contexts_part_first_give_no_pair_and_are_counted() -> None:
    tool_differs = [
        turn([1], [10], rollout=0, reward=1.0),
        turn([1, 10, 90], [20], rollout=0, reward=1.0),
        turn([1], [10], rollout=1, reward=0.0),
        turn([1, 10, 91], [21], rollout=1, reward=0.0),  # the tool answered the same call differently
    ]
    mined = mine_preference_pairs(tool_differs)
    assert mined.pairs == [] and mined.skipped_context == 1
    ended_early = [turn([1], [10], rollout=0, reward=1.0), turn([1], [10], rollout=1, reward=0.0)]
    ended_early.append(turn([1, 10, 90], [20], rollout=0, reward=1.0))
    assert mine_preference_pairs(ended_early) == mine_preference_pairs([])


def test_an_action_both_chosen_and_rejected_keeps_none_of_its_pairs() -> None:
    segments = [
        turn([1], [5], rollout=0, reward=1.0),
        turn([1], [6], rollout=1, reward=0.0),
        turn([1], [5], rollout=2, reward=0.0),  # answer 5 also ended a worst run...
        turn([1], [7], rollout=3, reward=1.0),  # ...which a best run answered with 7
    ]
    mined = mine_preference_pairs(segments)
    # (0,1) chooses 5 and (3,2) rejects it: both go; (3,1) stays; (0,2) never parted.
    assert mined.pairs == [((3,), (1,))] and mined.conflicting == 2
    assert mined.metrics() == {
        "preference/pairs": 1.0,
        "preference/skipped_context": 0.0,
        "preference/conflicting": 2.0,
        "preference/duplicates": 0.0,
        "preference/same_action": 0.0,
        "preference/low_reward": 0.0,
        "preference/turn_index_mean": 0.0,
        **{f"preference/turn_{k}": float(k == 0) for k in range(8)},
    }


def _call(name: str, arguments: str, text: str = "") -> dict[str, object]:
    function = {"name": name, "arguments": arguments}
    return {
        "role": "assistant",
        "content": text,
        "tool_calls": [{"id": "c0", "type": "function", "function": function}],
    }


def test_answers_that_are_the_same_action_in_other_words_make_no_pair_and_are_counted() -> None:
    segments = [
        # The same call: argument keys in another order, other spacing and text beside it.
        turn([1], [5], rollout=0, reward=1.0, reply=_call("get", '{"a": 1, "b": "x"}', "Sure.")),
        turn([1], [6], rollout=1, reward=0.0, reply=_call("get", '{"b":"x","a":1}')),
        # Replies differing only in case, spacing and a final stop.
        turn([2], [7], rollout=2, reward=1.0, group=1, reply={"role": "assistant", "content": "Done  now."}),
        turn([2], [8], rollout=3, reward=0.0, group=1, reply={"role": "assistant", "content": "done now"}),
        # Another argument value is another action.
        turn([3], [9], rollout=4, reward=1.0, group=2, reply=_call("get", '{"a": 1}')),
        turn([3], [10], rollout=5, reward=0.0, group=2, reply=_call("get", '{"a": 2}')),
    ]
    mined = mine_preference_pairs(segments)
    assert mined.pairs == [((4,), (5,))]
    assert mined.same_action == 2 and mined.metrics()["preference/same_action"] == 2.0


def test_a_minimum_chosen_reward_skips_groups_whose_best_run_fell_short() -> None:
    segments = [
        turn([1], [5], rollout=0, reward=0.25),
        turn([1], [6], rollout=1, reward=0.0),
        turn([2], [5], rollout=2, reward=1.0, group=1),
        turn([2], [6], rollout=3, reward=0.0, group=1),
    ]
    assert len(mine_preference_pairs(segments).pairs) == 2
    mined = mine_preference_pairs(segments, min_chosen_reward=0.75)
    assert mined.pairs == [((2,), (3,))] and mined.low_reward == 1


def test_each_pair_records_the_turn_it_parted_at() -> None:
    first = [turn([1], [5], rollout=0, reward=1.0), turn([1], [6], rollout=1, reward=0.0)]
    later = [
        turn([2], [10], rollout=2, reward=1.0, group=1),
        turn([2, 10, 90], [20], rollout=2, reward=1.0, group=1),
        turn([2], [10], rollout=3, reward=0.0, group=1),
        turn([2, 10, 90], [21], rollout=3, reward=0.0, group=1),
    ]
    mined = mine_preference_pairs(first + later)
    assert mined.turns == [0, 1]
    metrics = mined.metrics()
    assert metrics["preference/turn_index_mean"] == 0.5
    assert (metrics["preference/turn_0"], metrics["preference/turn_1"]) == (1.0, 1.0)


def test_marks_become_a_sides_matrix_of_the_pairs_whole_in_a_batch() -> None:
    segments = [
        turn([1], [a], rollout=i, reward=r) for i, (a, r) in enumerate([(5, 1.0), (6, 0.0), (7, 0.0)])
    ]
    marked = mark_pairs(segments, [((0,), (1,)), ((0,), (2,))])
    assert [s.preference_pairs for s in marked] == [((0, 1), (1, 1)), ((0, -1),), ((1, -1),)]
    sides = pair_sides([s.preference_pairs for s in marked])
    torch.testing.assert_close(sides, torch.tensor([[1.0, 1.0], [-1.0, 0.0], [0.0, -1.0]]))
    # Rows 0 and 1 only: pair 1's rejected row is elsewhere, so only pair 0 is whole here.
    torch.testing.assert_close(
        pair_sides([s.preference_pairs for s in marked[:2]]), torch.tensor([[1.0], [-1.0]])
    )
    assert pairs_split_across([marked[:2], marked[2:]]) == 1
    assert pairs_split_across([marked]) == 0


def test_the_loss_is_dpo_on_the_turns_summed_log_ratio_and_pulls_the_chosen_action_up() -> None:
    mask_B_T = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    reference_B_T = torch.tensor([[-1.0, -2.0, 0.0], [-1.5, 0.0, 0.0]])
    sides_B_P = torch.tensor([[1.0], [-1.0]])
    # Learner equal to the reference: margin 0, loss log 2.
    loss, stats = preference_loss(reference_B_T.clone(), reference_B_T, mask_B_T, sides_B_P, beta=0.5)
    assert float(loss) == pytest.approx(math.log(2.0))
    assert stats["preference/margin"] == 0.0 and stats["preference/accuracy"] == 0.0
    # Masked positions never count; the gradient raises the chosen row's tokens and lowers the other's.
    learner_B_T = (reference_B_T + torch.tensor([[0.2, 0.1, 9.0], [0.4, 9.0, 9.0]])).requires_grad_()
    loss, stats = preference_loss(learner_B_T, reference_B_T, mask_B_T, sides_B_P, beta=0.5)
    margin = (0.2 + 0.1) - 0.4
    assert stats["preference/margin"] == pytest.approx(margin)
    assert float(loss.detach()) == pytest.approx(-math.log(1 / (1 + math.exp(-0.5 * margin))))
    loss.backward()
    assert learner_B_T.grad is not None
    assert (learner_B_T.grad[0, :2] < 0).all() and (learner_B_T.grad[1, :1] > 0).all()
    assert float(learner_B_T.grad[0, 2]) == 0.0 and float(learner_B_T.grad[1, 1:].abs().sum()) == 0.0
    # No whole pair in the batch: zero, still part of the graph.
    empty, none = preference_loss(learner_B_T, reference_B_T, mask_B_T, torch.zeros((2, 0)), beta=0.5)
    assert float(empty.detach()) == 0.0 and empty.requires_grad and none == {}


def _hp(**fields: object) -> HyperParameters:
    return HyperParameters.model_validate(fields)


def _shaped(segments: list[LLMCall], hp: HyperParameters) -> tuple[list[LLMCall], dict[str, float]]:
    shaped = asyncio.run(shape_signal(segments, 0, hp))
    return shaped.segments, shaped.metrics


def test_the_signal_phase_mines_and_marks_pairs_only_when_asked() -> None:
    segments = [turn([1], [5], rollout=0, reward=1.0), turn([1], [6], rollout=1, reward=0.0)]
    kept, metrics = _shaped(segments, _hp())
    assert "preference/pairs" not in metrics and all(s.preference_pairs == () for s in kept)
    kept, metrics = _shaped(segments, _hp(turn_preference_coef=0.5))
    assert metrics["preference/pairs"] == 1.0 and metrics["preference/conflicting"] == 0.0
    assert [s.preference_pairs for s in kept] == [((0, 1),), ((0, -1),)]
    # Mini-batches of whole prompt groups keep the pair together.
    assert pairs_split_across(minibatches(kept, 2)) == 0 and pairs_split_across(minibatches(kept, 1)) == 1


def test_the_job_spec_names_the_preference_fields() -> None:
    with pytest.raises(ValueError, match="turn_preference_beta"):
        _hp(turn_preference_beta=0)
    with pytest.raises(ValueError, match="turn_preference_coef"):
        _hp(turn_preference_coef=-1)


def test_ranks_reduce_the_preference_metrics_over_the_ranks_that_report_them() -> None:
    from opd_trainer.learner.deepspeed_learner import reduce_rank_metrics

    with_pairs = {"loss": 1.0, "preference/loss": 0.6, "preference/accuracy": 0.5}
    without = {"loss": 3.0}
    assert reduce_rank_metrics([with_pairs, without]) == {
        "loss": 2.0,
        "preference/loss": 0.6,
        "preference/accuracy": 0.5,
    }


def test_outcome_level_pairs_whole_trajectories_and_shared_turns_cancel() -> None:
    from opd_trainer.signal.pairs import mine_outcome_pairs

    good = [turn([1], [10], rollout=0, reward=1.0), turn([1, 10, 90], [20], rollout=0, reward=1.0)]
    bad = [turn([1], [10], rollout=1, reward=0.0), turn([1, 10, 90], [21], rollout=1, reward=0.0)]
    tie = [turn([2], [5], rollout=2, reward=1.0, group=1), turn([2], [6], rollout=3, reward=1.0, group=1)]
    mined = mine_outcome_pairs(good + bad + tie)
    assert mined.pairs == [((0, 1), (2, 3))] and mined.metrics()["preference/pairs"] == 1.0
    marked = mark_pairs(good + bad + tie, mined.pairs)
    sides = pair_sides([s.preference_pairs for s in marked])
    torch.testing.assert_close(sides, torch.tensor([[1.0], [1.0], [-1.0], [-1.0], [0.0], [0.0]]))
    # The shared first turn has the same log-ratio on both sides: only the parting turns move the margin.
    mask_B_T = torch.ones((6, 1))
    reference_B_T = torch.zeros((6, 1))
    learner_B_T = torch.tensor([[0.7], [0.5], [0.7], [0.2], [9.0], [9.0]])
    _, stats = preference_loss(learner_B_T, reference_B_T, mask_B_T, sides, beta=1.0)
    assert stats["preference/margin"] == pytest.approx(0.5 - 0.2)
    kept, metrics = _shaped(good + bad, _hp(turn_preference_coef=1.0, preference_level="outcome"))
    assert metrics["preference/pairs"] == 1.0 and [s.preference_pairs for s in kept] == [
        ((0, 1),),
        ((0, 1),),
        ((0, -1),),
        ((0, -1),),
    ]
