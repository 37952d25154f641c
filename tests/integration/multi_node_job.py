"""Run by `test_multi_node.py` in its own process: an Agentic OPD job on a five-node Ray cluster.

`ray.cluster_utils.Cluster` starts five Ray nodes on this machine, each advertising a custom resource
that the job spec (or, for the processor pools, `OPD_USER_CODE_RESOURCE`, as the Helm chart sets it)
asks for, the way a user places a job on node types:
  head      the job driver and the gateways
  student   the student engine        (resources.student.ray_resources)
  teacher   the teacher engine        (resources.teacher.ray_resources)
  learner   the learner rank          (resources.learner_ray_resources)
  pools     rollout / reward / evaluator workers (OPD_USER_CODE_RESOURCE)
The learner and the student engine sit on different nodes, so `weight_transfer: auto` must move the
weights through Ray's object store after every step. Prints one JSON line: the job's summary, where
Ray placed each kind of actor, and the per-step importance ratio (1 when the engine samples with the
learner's weights).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster
from test_any_task import AGENT_WORKSPACE, EVALUATOR_WORKSPACE, SMALL_POOL  # this script's folder

from opd_trainer.demo.tiny_models.serving import TINY_KV_CACHE_BYTES
from opd_trainer.driver.job_driver import JobDriver
from opd_trainer.driver.ray_runtime import remove_runtime_resources
from opd_trainer.driver.run_dir import RunDir
from opd_trainer.jsonl import read_jsonl, write_jsonl
from opd_trainer.spec.job_spec import parse_job_spec

NODES = {"head": 2, "student": 1, "teacher": 1, "learner": 1, "pools": 2}  # name -> CPUs


def job(student: Path, teacher: Path, data: Path, work: Path) -> dict[str, Any]:
    validation = work / "validation.jsonl"
    write_jsonl(validation, read_jsonl(data / "validation.jsonl")[:8])

    def component(name: str, kind: str, workspace: Path, classpath: str) -> dict[str, Any]:
        fcmodel = {"zipdir": str(workspace), "classpath": classpath}
        return {"name": name, "type": kind, "fcmodel": fcmodel, "runtime": SMALL_POOL, "timeout": 60}

    engine = {"kv_cache_memory_bytes": TINY_KV_CACHE_BYTES, "dtype": "float32"}
    return {
        "job_name": "multi-node",
        "model": str(student),
        "teacher_model": str(teacher),
        "training_datasets": [str(data / "train.jsonl")],
        "validation_datasets": [str(validation)],
        "functions": [
            component("agent", "rollout", AGENT_WORKSPACE, "functions.rollout.ToolRoutingRollout"),
            component("decision", "reward", AGENT_WORKSPACE, "functions.reward.DecisionReward"),
            component(
                "tool-routing", "evaluator", EVALUATOR_WORKSPACE, "functions.evaluator.ToolRoutingEvaluator"
            ),
        ],
        "hyper_parameters": {
            "max_steps": 3,
            "batch_size": 4,
            "n_rollouts": 2,
            "ppo_mini_batch_size": 8,
            "max_tokens": 48,
            "learning_rate": 1e-3,
            "lr_scheduler_type": "constant",
            "eval_steps": 100,
            "save_steps": 100,
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


def main(student: Path, teacher: Path, data: Path) -> dict[str, Any]:
    from ray.util.state import list_actors

    work = Path(tempfile.mkdtemp(prefix="opd-multi-node-"))
    spec = parse_job_spec(job(student, teacher, data, work))
    driver = (
        ray.remote(JobDriver)
        .options(
            num_cpus=0,
            resources={"head_node": 0.01},
            runtime_env={"env_vars": {"OPD_USER_CODE_RESOURCE": "pools_node"}},
        )
        .remote(spec, str(work / "run"))
    )
    try:
        summary = ray.get(driver.run.remote())
    finally:
        ray.kill(driver)
    node_of = {
        node["NodeID"]: name for node in ray.nodes() for name in NODES if f"{name}_node" in node["Resources"]
    }
    placed: dict[str, list[str]] = {}
    for actor in list_actors(detail=True, limit=10_000):
        placed.setdefault(actor.class_name, []).append(node_of.get(actor.node_id, "?"))
    events = [json.loads(line) for line in (work / "run" / "events.jsonl").read_text().splitlines()]
    transfers = [e["data"]["weight_transfers"] for e in events if "weight_transfers" in e.get("data", {})]
    steps = [r for r in RunDir(work / "run").records() if r["kind"] == "train"]
    return {
        "succeeded": "student_after" in summary,
        "exact_match_after": summary.get("student_after", {}).get("exact_match"),
        "weight_transfers": transfers,
        "placed": {name: sorted(set(nodes)) for name, nodes in placed.items()},
        "ratio_mean": [r["ratio_mean"] for r in steps],
        "steps": len(steps),
    }


if __name__ == "__main__":
    cluster = Cluster()
    for name, cpus in NODES.items():
        cluster.add_node(num_cpus=cpus, resources={f"{name}_node": 100})
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))))
    finally:
        session_dir = Path(cluster.head_node.get_session_dir_path())
        ray.shutdown()
        cluster.shutdown()
        remove_runtime_resources(session_dir)
