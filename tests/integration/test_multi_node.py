"""Weights cross Ray nodes: a cluster of several nodes (`ray.cluster_utils.Cluster`) in a process of its
own, since the other integration tests share one single-node Ray in this process.

One process and one cluster serve the four tests (`multi_node_job.py all`): the weight handoff check,
then the agentic job, then the job that loses its pool node, then the one that loses its student
engine's node; each test asserts on its part of the result. Starting a five-node cluster and importing
Ray, torch and vLLM costs ~40 s on 2 cores; paid once, not 4x.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from opd_trainer.demo.tiny_models import TinyModels

# The fixture runs all four parts in the first test's time: the bounds the parts have, summed.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(3000 + 300)]

JOB_SCRIPT = Path(__file__).with_name("multi_node_job.py")


@pytest.fixture(scope="module")
def results(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`multi_node_job.py all`: the weight-sync check ("weight_sync"), "agentic", "model-kill",
    "engine-node-kill"."""
    result = tmp_path_factory.mktemp("multi-node") / "result.json"
    done = subprocess.run(
        [
            sys.executable,
            str(JOB_SCRIPT),
            str(tiny_models.student),
            str(tiny_models.teacher),
            str(tiny_models.data_dir),
            "all",
            str(result),
        ],
        capture_output=True,
        text=True,
        timeout=600 + 900 + 900 + 600,  # what the three processes had, and the engine node's loss
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(result.read_text())  # type: ignore[no-any-return]


def test_every_replica_gets_the_weights_by_the_handoff_its_node_allows(results: dict[str, Any]) -> None:
    """Two student replicas, one beside the weights and one on another node: one update reaches
    both, by shared memory and through Ray's object store."""
    result = results["weight_sync"]
    assert result["nodes"] == [False, True]  # replica 0 on another node, replica 1 beside the weights
    assert result["auto"] == ["ray", "shm"] and result["shm_refused"] is True
    assert result["versions"] == [7, 7] and result["tokens"] >= 4
    # Before: the student's own weights score differently; after: the teacher's weights, as sent.
    assert min(result["before_vs_teacher"]) > 1e-2
    assert max(result["after_vs_teacher"]) < 1e-3, result


def _sampled_with_the_learners_weights(ratio_mean: list[float]) -> bool:
    # Each step samples with the weights the learner published after the step before it (on-policy):
    # the learner's and the sampler's logprobs of the sampled tokens agree, step after step (measured:
    # within 6e-7 of 1; at learning rate 1e-3 an engine a step behind would be far off).
    return all(abs(ratio - 1.0) < 5e-3 for ratio in ratio_mean)


def test_an_agentic_job_runs_across_five_nodes(results: dict[str, Any]) -> None:
    """Driver, student engine, teacher engine, learner and processor pools each on a node of their own
    (custom Ray resources in the job spec, `OPD_USER_CODE_RESOURCE` for the pools); weights reach the
    student engine from the learner's node through Ray's object store after every step."""
    result = results["agentic"]
    assert result["succeeded"] and result["steps"] == 3, result
    assert result["weight_transfers"] == [["ray"]]
    placed = result["placed"]
    assert placed["MultiNodeJobDriver"] == ["head"]
    # The gateways live in the student engine's process: no process of their own that Ray could put
    # on a node the job may lose.
    assert "GatewayHost" not in placed, placed
    assert placed["Learner"] == ["learner"]
    assert placed["StudentEngine"] == ["student"] and placed["TeacherEngine"] == ["teacher"], placed
    workers = [name for name in placed if "Worker" in name and name != "WorkerPool"]
    assert workers and all(placed[name] == ["pools"] for name in workers), placed
    assert _sampled_with_the_learners_weights(result["ratio_mean"]), result["ratio_mean"]


def test_a_model_opd_job_survives_losing_its_pool_node(results: dict[str, Any]) -> None:
    """A Model OPD job (built-in rollout, a user reward) on the same layout. Once its first step is
    written the node holding the reward pool is killed without warning and another joins: the pool
    replaces its worker there, the call in flight is retried, and the job finishes every step.
    Measured: the worker replaced during step 3, no rollout failed, 3 min 40 s (with 4 steps; CI then
    once finished all 4 before the node was gone, so the job has 8)."""
    result = results["model-kill"]
    assert result["succeeded"] and result["steps"] == 8, result
    assert result["steps_when_killed"] < 8, result  # the node went while the job ran
    assert result["weight_transfers"] == [["ray"]]
    assert result["placed"]["ProcessorWorker"] == ["pools", "spare"], result["placed"]
    # CI once lost the job with the pool node: Ray had put the (zero-CPU) gateway actor there. The
    # gateways live in the student engine's process.
    assert result["placed"]["StudentEngine"] == ["student"], result["placed"]
    assert result["placed"]["TeacherEngine"] == ["teacher"], result["placed"]
    assert "GatewayHost" not in result["placed"], result["placed"]
    # A replacement started just as the node went may never be placed (seen once: one such worker,
    # dead, beside the replacement that served); none may be left alive.
    assert all(entry == "ProcessorWorker:DEAD" for entry in result["never_placed"]), result
    assert result["workers_replaced"][0] == 0 and result["workers_replaced"][-1] >= 1, result
    # A call on the lost worker fails with RayActorError within seconds and goes to the new worker.
    assert all(mean is not None for mean in result["reward_mean"]), result
    assert sum(result["failed_rollouts"]) == 0, result
    assert _sampled_with_the_learners_weights(result["ratio_mean"]), result["ratio_mean"]


def test_a_job_survives_losing_its_student_engines_node(results: dict[str, Any]) -> None:
    """The same Model OPD job; once its first step is written the node holding its student engine is
    killed without warning (a replacement node advertising the same resource joined during start-up).
    The step under way fails, the driver finds the engine dead, restarts the job's parts (the student
    engine on the new node) and resumes from the checkpoint of the last finished step (the job saves
    every step); the new engine gets the learner's weights through Ray's object store."""
    result = results["engine-node-kill"]
    assert result["succeeded"] and result["train_steps"] == [1, 2, 3, 4], result
    assert result["steps_when_killed"] < 4, result  # the node went while the job ran
    [recovery] = result["recoveries"]
    assert [lost["name"] for lost in recovery["lost"]] == ["student engine replica 0"], recovery
    assert recovery["recovery"] == 1 and recovery["step"] >= 1, recovery
    assert recovery["resumes_from"] == recovery["step"], recovery  # only the step under way is redone
    assert result["resumed"], result
    placed = result["placed"]
    # The first student engine on the lost node, its replacement on the node that joined.
    assert placed["StudentEngine"] == ["student", "student_spare"], placed
    assert placed["TeacherEngine"] == ["teacher"], placed
    assert placed["Learner"] == ["learner"], placed
    assert not result["never_placed"], result
    # The new engine samples with the weights of the checkpoint resumed from and of every step after.
    assert result["weight_transfers"] == [["ray"], ["ray"]], result
    assert _sampled_with_the_learners_weights(result["ratio_mean"]), result["ratio_mean"]
