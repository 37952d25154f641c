"""The self-correction example end to end: its agent plays episodes against the tool backend in a real
worker pool, through the gateway, and its reward judges them in another; validation reports the
agent-level metrics. Run on the demo's tiny teacher as the student (it makes the first call right, so
moved items really answer with errors), with the turn-level hindsight term, the turn-level preference
term, hindsight beacons written by a user's beacon component in its own sandboxed pool (the teacher
rewrites each turn it gives feedback for: the pipeline, not a method for this task, whose errors the agent
cannot foresee) and `teacher_hindsight: outcome` on."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from driver_runs import run_driver

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tool_routing.self_correction import make_episodes, score_episode
from opd_trainer.jobspec.job_spec import load_job_spec
from opd_trainer.jsonl import write_jsonl
from opd_trainer.storage.run_dir import RunDir

pytestmark = pytest.mark.integration

EXAMPLE_JOB = Path(__file__).resolve().parents[2] / "examples" / "self_correction_agentic" / "job.yaml"
# A user's beacon component: feedback for each turn whose call hit a moved item, from the tool's answer;
# it raises for one rollout (user code failing: counted, the step goes on).
BEACON_PROCESSOR = """
import json

from opd_trainer.sdk import AbstractBeaconProcessor, Beacon, BeaconInput, BeaconOutput


class MovedItemBeacon(AbstractBeaconProcessor):
    def process(self, beacon_input: BeaconInput) -> BeaconOutput:
        if beacon_input.request_metadata.rollout_id.endswith("-r3"):
            raise ValueError("this rollout's feedback cannot be written")
        beacons = []
        for turn in beacon_input.turns:
            for answer in turn.tool_answers:
                moved = json.loads(answer["content"]).get("moved_to")
                if moved:
                    feedback = f"That item moved to {moved}: make the same call on {moved}."
                    beacons.append(Beacon(turn=turn.turn, feedback=feedback))
        return BeaconOutput(beacons=beacons)
"""


def test_self_correction_episodes_train_and_validate(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    train, validation = tmp_path / "train.jsonl", tmp_path / "validation.jsonl"
    episodes = {"train": make_episodes("train", 16), "validation": make_episodes("validation", 8)}
    write_jsonl(train, episodes["train"])
    write_jsonl(validation, episodes["validation"])
    workspace = tmp_path / "beacon_workspace"
    (workspace / "coach").mkdir(parents=True)
    (workspace / "coach" / "__init__.py").write_text("")
    (workspace / "coach" / "beacons.py").write_text(BEACON_PROCESSOR)
    spec = load_job_spec(EXAMPLE_JOB)
    data = spec.model_dump()
    beacon = {
        "name": "coach",
        "type": "beacon",
        "fcmodel": {"zipdir": str(workspace), "classpath": "coach.beacons.MovedItemBeacon"},
        "timeout": 30,
        "runtime": {"cpu": 0.25, "memory_size": 512, "concurrency": 16, "capacity": 1, "max_capacity": 1},
    }
    data.update(
        functions=[*data["functions"], beacon],
        model=str(tiny_models.teacher),
        teacher_model=str(tiny_models.teacher),
        training_datasets=[str(train)],
        validation_datasets=[str(validation)],
    )
    data["hyper_parameters"].update(
        max_steps=1,
        eval_steps=1,
        batch_size=8,
        n_rollouts=2,
        ppo_mini_batch_size=16,
        hindsight_coef=1.0,
        teacher_hindsight="outcome",
        turn_preference_coef=1.0,
        beacon_rewrite="teacher",
        # Sampled: the tiny teacher does not read a system note, and greedily repeats the turn (at 1.0,
        # 9 of 10 rewrites repeated it; at 2.0, 9 of 10 differed).
        beacon_temperature=2.0,
    )
    run_dir = tmp_path / "run"
    run_driver(type(spec).model_validate(data), run_dir)

    records = RunDir(run_dir).records()
    (step,) = [r for r in records if r["kind"] == "train"]
    assert step["failed_rollouts"] == 0 and step["rollouts"] == 16
    assert {"reward_mean", "rollout/tool_errors", "rollout/turns", "hindsight/turns_up"} <= set(step)
    # Turn-level preference pairs come from the same best/worst walk as the hindsight signal: with 2
    # rollouts a prompt has at most one pair and prompts differ, so none conflicts or repeats, and one
    # mini-batch of 16 keeps every pair whole. (Runs that part only after their contexts did give
    # neither; the learner's side of the term: test_agentic_opd.py.)
    assert step["preference/pairs"] == step["hindsight/turns_up"] == step["hindsight/turns_down"], step
    for count in ("conflicting", "duplicates", "split_pairs"):
        assert step[f"preference/{count}"] == 0, step
    # Beacons: the component, in its own sandboxed pool, gave feedback for the turns whose call hit a moved
    # item; each was rewritten by the real teacher engine and either paired (and trained by the preference
    # term) or dropped for a counted reason. The rollout it raised for is counted, and the step went on.
    beacons = {
        name: step[f"beacons/{name}"]
        for name in ("turns", "pairs", "unchanged", "cut_off", "leaked", "skipped")
    }
    assert beacons["turns"] == sum(v for k, v in beacons.items() if k != "turns"), beacons
    assert step["rollout/tool_errors"] > 0 and beacons["turns"] >= 1, (step["rollout/tool_errors"], beacons)
    assert beacons["pairs"] >= 1 and step["time/beacons_s"] > 0, beacons
    assert step["beacons/failed"] == 1 and step["beacons/unknown_turn"] == 0, step
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["message"].startswith("coach runs in ") for e in events if e["type"] == "status")
    # The learner trained them: DPO's loss on whole pairs (one mini-batch of 16 holds every one).
    assert 0 < step["preference/loss"] < 10 and 0 <= step["preference/accuracy"] <= 1, step
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1]
    for record in evals:
        names = ("agent/task_success", "agent/turn_success", "agent/tool_call_accuracy")
        # The agent runs tools: the loop share is always reported (self-correction metrics, agent_eval).
        for name in (*names, "agent/repeated_failing_call_share"):
            assert 0.0 <= record[name] <= 1.0, (name, record[name])
        assert "reward/episode/calls_correct" in record

    trajectories = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    by_id = {r["rollout_extra"]["sample_id"]: r for split in episodes.values() for r in split}
    errors_seen = 0
    for trajectory in trajectories:
        episode = by_id[trajectory["sample_id"]]
        extra, messages = episode["rollout_extra"], trajectory["messages"]
        score = score_episode(messages, len(episode["messages"]), extra["solution"])
        # The reward that came back from the reward pool is the episode judge's verdict on these messages.
        assert trajectory["reward"] == (1.0 if score.success else 0.5 if score.calls_correct else 0.0)
        for message, reply in itertools.pairwise(messages):
            if message.get("tool_calls") and reply["role"] == "tool" and "moved_to" in reply["content"]:
                ((old, new),) = extra["moved"].items()
                assert json.loads(reply["content"]) == {"error": f"item {old} was moved", "moved_to": new}
                errors_seen += 1
        assert trajectory["rollout_metrics"]["turns"] >= 1
    # Half the episodes move their item and the teacher makes the first call right nearly always.
    assert errors_seen >= 2
    # Every paired rewrite is shown beside the turn it is preferred over (all 16 rollouts are recorded),
    # with the component's feedback under the beacon header.
    shown = [
        call["tokens"]["signal"]["rewrite"]
        for trajectory in trajectories
        for call in trajectory["llm_calls"]
        if call.get("tokens") and "rewrite" in call["tokens"].get("signal", {})
    ]
    assert len(shown) == beacons["pairs"], (len(shown), beacons)
    assert all(r["text"] and "That item moved to " in r["beacon"] for r in shown), shown
