"""Run by `test_multi_node.py` in its own process: an OPD job on a Ray cluster of several nodes.

`ray.cluster_utils.Cluster` starts Ray nodes on this machine, each advertising a custom resource that
the job spec (or, for the processor pools, `OPD_USER_CODE_RESOURCE`, as the Helm chart sets it) asks
for, the way a user places a job on node types:
  head      the job driver and the gateways
  student   the student engine        (resources.student.ray_resources)
  teacher   the teacher engine        (resources.teacher.ray_resources)
  learner   the learner rank          (resources.learner_ray_resources)
  pools     rollout / reward / evaluator workers (OPD_USER_CODE_RESOURCE)
The learner and the student engine sit on different nodes, so `weight_transfer: auto` must move the
weights through Ray's object store after every step.

`agentic`: an Agentic OPD job (user rollout, reward and evaluator) on those five nodes.
`model-kill`: a Model OPD job (built-in rollout, a user reward) whose pool node is killed without
warning once the first step is written; a second pool node joins then, and the pool must re-form on it.
`engine-node-kill`: the same job (4 steps, a checkpoint each), whose student engine's node is killed
without warning once the first step is written; a replacement node advertising the same resource joins
once the engine is placed (its start-up overlaps the job's), so the driver's recovery restarts the job's
parts, the student engine on the new node, and resumes from the latest checkpoint.
`all`: on one cluster (its start-up, ~30 s on 2 cores, paid once), `multi_node_weight_sync.py`'s check
first (its node A is the head, its node B the pool node), then `agentic`, then `model-kill` and
`engine-node-kill` (last: each loses a node; the second's reward pool runs on the first's spare node).
Each job's placement counts only the actors created after it was submitted.

Writes one JSON object to the file its fifth argument names: the job's summary, where Ray placed
each kind of actor (a dead node's actors count too), the weight handoffs used and the per-step
metrics that tell whether the engine sampled with the learner's weights; for `all`, one such object per
mode and the weight-sync check's result under "weight_sync".
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster
from test_any_task import AGENT_WORKSPACE, EVALUATOR_WORKSPACE, SMALL_POOL  # this script's folder

from opd_trainer.cluster.ray_runtime import remove_runtime_resources
from opd_trainer.demo.tiny_models.serving import TINY_KV_CACHE_BYTES
from opd_trainer.driver.job_driver import JobDriver
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.jsonl import read_jsonl, write_jsonl
from opd_trainer.storage.run_dir import RunDir

NODES = {"head": 2, "student": 1, "teacher": 1, "learner": 1, "pools": 2}  # name -> CPUs
# The nodes that join mid-job, named by a resource of their own: the pool node's replacement
# (`model-kill`) and the student engine node's (`engine-node-kill`).
SPARES = ("spare", "student_spare")
# `multi_node_weight_sync.py`'s two nodes, for `all`: A (the weights' node) and B, each with 2 CPUs there too.
WEIGHT_SYNC_NODES = {"head": "node_a", "pools": "node_b"}


class MultiNodeJobDriver(JobDriver):
    """`JobDriver` under a process title of its own (`ray::MultiNodeJobDriver`): test_recovery.py's
    driver-death test SIGKILLs every `ray::JobDriver` process started while its job runs, which on a
    machine shared with another test run took this script's driver too."""


def component(name: str, kind: str, workspace: Path, classpath: str) -> dict[str, Any]:
    fcmodel = {"zipdir": str(workspace), "classpath": classpath}
    return {"name": name, "type": kind, "fcmodel": fcmodel, "runtime": SMALL_POOL, "timeout": 60}


def job(mode: str, student: Path, teacher: Path, data: Path, work: Path) -> dict[str, Any]:
    validation = work / "validation.jsonl"
    write_jsonl(validation, read_jsonl(data / "validation.jsonl")[:8])
    decision = component("decision", "reward", AGENT_WORKSPACE, "functions.reward.DecisionReward")
    if mode == "agentic":
        functions = [
            component("agent", "rollout", AGENT_WORKSPACE, "functions.rollout.ToolRoutingRollout"),
            decision,
            component(
                "tool-routing", "evaluator", EVALUATOR_WORKSPACE, "functions.evaluator.ToolRoutingEvaluator"
            ),
        ]
        train, validation_datasets, steps = data / "train.jsonl", [str(validation)], 3
    else:  # the built-in rollout on the arithmetic data, the reward pool alone holding user code
        functions = [decision]
        # Steps enough that the pool node is gone while the job still runs: the node is killed after
        # step 1 is written and adding the spare node first takes a few steps' time on a loaded box
        # (CI once finished all of 4 steps before the kill).
        # `engine-node-kill`: its replacement node joins during start-up, so the kill follows step 1
        # within a second or two.
        train, validation_datasets, steps = data / "train.jsonl", [], 8 if mode == "model-kill" else 4
    # `engine-node-kill` checkpoints every step (a tiny model's: ~0.1 s): the kill may land in the step's
    # rollouts, before the driver's own checkpoint of the finished step, or in its update or weight
    # publish, after which there is none and the job would restart from scratch (seen on an idle box);
    # either way it resumes from the last finished step.
    save_steps = 1 if mode == "engine-node-kill" else 100
    engine = {"kv_cache_memory_bytes": TINY_KV_CACHE_BYTES, "dtype": "float32"}
    return {
        "job_name": f"multi-node-{mode}",
        "model": str(student),
        "teacher_model": str(teacher),
        "training_datasets": [str(train)],
        "validation_datasets": validation_datasets,
        "functions": functions,
        "hyper_parameters": {
            "max_steps": steps,
            "batch_size": 4,
            "n_rollouts": 2,
            "ppo_mini_batch_size": 8,
            "max_tokens": 48,
            "learning_rate": 1e-3,
            "lr_scheduler_type": "constant",
            "eval_steps": 100,
            "save_steps": save_steps,
            "seed": 5,
        },
        "resources": {
            "student": {**engine, "ray_resources": {"student_node": 1}},
            "teacher": {**engine, "ray_resources": {"teacher_node": 1}},
            "learner_gpus": 0,
            "learner_ray_resources": {"learner_node": 1},
            "weight_transfer": "auto",
            "placement_timeout_s": 300,
        },
    }


def wait_for_first_step(run: Path, finished: ray.ObjectRef, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (run / "metrics.jsonl").exists() and any(r["kind"] == "train" for r in RunDir(run).records()):
            return
        ready, _ = ray.wait([finished], timeout=1.0)
        if ready:
            ray.get(ready[0])  # raises the job's error
            raise RuntimeError("the job ended before its first step was written")
    raise TimeoutError("no step written")


def wait_for_engine_placed(
    class_name: str, earlier: set[str], finished: ray.ObjectRef, count: int = 1, timeout_s: float = 600
) -> None:
    """Until Ray has given a node to `count` actors of `class_name` created after `earlier`."""
    from ray.util.state import list_actors

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        actors = list_actors(filters=[("class_name", "=", class_name)], detail=True, limit=10_000)
        if sum(1 for actor in actors if actor.node_id and actor.actor_id not in earlier) >= count:
            return
        ready, _ = ray.wait([finished], timeout=1.0)
        if ready:
            ray.get(ready[0])  # raises the job's error
            raise RuntimeError(f"the job ended before its {class_name} was placed")
    raise TimeoutError(f"no {class_name} placed")


def main(
    mode: str, cluster: Cluster, nodes: dict[str, Any], student: Path, teacher: Path, data: Path
) -> dict[str, Any]:
    from ray.util.state import list_actors

    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="opd-multi-node-"))
    spec = parse_job_spec(job(mode, student, teacher, data, work))
    # Actors of what ran on this cluster before (`all`) are not this job's.
    earlier = {actor.actor_id for actor in list_actors(detail=True, limit=10_000)}
    driver = (
        ray.remote(MultiNodeJobDriver)
        .options(
            num_cpus=0,
            resources={"head_node": 0.01},
            runtime_env={"env_vars": {"OPD_USER_CODE_RESOURCE": "pools_node"}},
        )
        .remote(spec, str(work / "run"))
    )
    node_of = {}
    steps_when_killed = None
    try:
        finished = driver.run.remote()
        if mode == "model-kill":
            wait_for_first_step(work / "run", finished)
            cluster.add_node(num_cpus=2, resources={"pools_node": 100, "spare_node": 1})
            node_of[nodes["pools"].node_id] = "pools"  # ray.nodes() forgets its resources once it is gone
            cluster.remove_node(nodes["pools"], allow_graceful=False)
            steps_when_killed = sum(1 for r in RunDir(work / "run").records() if r["kind"] == "train")
        elif mode == "engine-node-kill":
            # Once the student's and the teacher's engines have their nodes (else Ray could place the
            # student on the replacement), while the job still starts: adding a node takes many
            # seconds on a loaded box.
            wait_for_engine_placed("StudentEngine", earlier, finished)
            wait_for_engine_placed("TeacherEngine", earlier, finished)
            cluster.add_node(
                num_cpus=NODES["student"], resources={"student_node": 100, "student_spare_node": 1}
            )
            wait_for_first_step(work / "run", finished)
            node_of[nodes["student"].node_id] = "student"
            cluster.remove_node(nodes["student"], allow_graceful=False)
            steps_when_killed = sum(1 for r in RunDir(work / "run").records() if r["kind"] == "train")
        summary = ray.get(finished)
    finally:
        ray.kill(driver)
    for node in ray.nodes():
        names = [name for name in (*NODES, *SPARES) if f"{name}_node" in node["Resources"]]
        node_of.setdefault(node["NodeID"], names[-1] if names else "?")
    placed: dict[str, list[str]] = {}
    never_placed: list[str] = []
    for actor in list_actors(detail=True, limit=10_000):
        if actor.actor_id in earlier:
            continue
        if not actor.node_id:  # created, but Ray never gave it a node (its start failed or was abandoned)
            never_placed.append(f"{actor.class_name}:{actor.state}")
            continue
        placed.setdefault(actor.class_name, []).append(node_of.get(actor.node_id, "?"))
    events = [json.loads(line) for line in (work / "run" / "events.jsonl").read_text().splitlines()]
    transfers = [e["data"]["weight_transfers"] for e in events if "weight_transfers" in e.get("data", {})]
    steps = [r for r in RunDir(work / "run").records() if r["kind"] == "train"]
    return {
        "succeeded": [e["message"] for e in events if e["type"] == "status"][-1] == "succeeded",
        "exact_match_after": summary.get("student_after", {}).get("exact_match"),
        "weight_transfers": transfers,
        "placed": {name: sorted(set(nodes)) for name, nodes in placed.items()},
        "never_placed": never_placed,
        "ratio_mean": [r["ratio_mean"] for r in steps],
        "steps": len(steps),
        "train_steps": [r["step"] for r in steps],
        "steps_when_killed": steps_when_killed,
        "recoveries": [e["data"] for e in events if e["type"] == "recovery"],
        "resumed": [e["message"] for e in events if e["message"].startswith("resumed from checkpoint")],
        "reward_mean": [r.get("reward_mean") for r in steps],
        "failed_rollouts": [r["failed_rollouts"] for r in steps],
        "workers_replaced": [r["pool/decision/workers_replaced"] for r in steps],
        "wall_s": round(time.monotonic() - began, 1),
    }


def main_all(
    cluster: Cluster, nodes: dict[str, Any], student: Path, teacher: Path, data: Path
) -> dict[str, Any]:
    from multi_node_weight_sync import main as weight_sync  # this script's folder

    # Its engines and weight holder go when its handles do, before the jobs ask for those CPUs.
    results: dict[str, Any] = {"weight_sync": asyncio.run(weight_sync(str(student), str(teacher)))}
    for mode in ("agentic", "model-kill", "engine-node-kill"):
        results[mode] = main(mode, cluster, nodes, student, teacher, data)
    return results


if __name__ == "__main__":
    mode = sys.argv[4] if len(sys.argv) > 4 else "agentic"
    cluster = Cluster()
    nodes = {
        name: cluster.add_node(
            num_cpus=cpus,
            resources={
                f"{name}_node": 100,
                **({WEIGHT_SYNC_NODES[name]: 1} if mode == "all" and name in WEIGHT_SYNC_NODES else {}),
            },
        )
        for name, cpus in NODES.items()
    }
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        arguments = (Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
        if mode == "all":
            result = main_all(cluster, nodes, *arguments)
        else:
            result = main(mode, cluster, nodes, *arguments)
        # A file, not stdout: the raylets of nodes added later print their own lines there.
        Path(sys.argv[5]).write_text(json.dumps(result))
    finally:
        session_dir = Path(cluster.head_node.get_session_dir_path())
        ray.shutdown()
        cluster.shutdown()
        remove_runtime_resources(session_dir)
