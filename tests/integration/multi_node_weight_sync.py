"""Run by `test_multi_node.py` in its own process: a two-node Ray cluster on this machine.

Node A holds the weights (as the learner does), the student engine group has a replica on node B and
one on node A. `auto` must give the replica on B the object store and the one on A shared memory,
`shm` must be refused, and after one update both replicas score like the teacher whose weights were
sent. Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import ray
import torch
from ray.cluster_utils import Cluster
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from opd_trainer.cluster.ray_runtime import remove_runtime_resources
from opd_trainer.demo.tiny_models.serving import tiny_engine_config
from opd_trainer.engine.vllm_engine import EngineActor, EngineGroup
from opd_trainer.weight_sync.transports import export_weights, release_weights


@ray.remote(num_cpus=0, resources={"node_a": 0.01})
class WeightHolder:
    """Stands where the learner stands: owns the object-store copy of the weights it exports."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def export(self, kinds: list[str]) -> dict[str, object]:
        """As `Learner.export_weights`: one handoff per kind."""
        return export_weights(load_file(str(Path(self.model_dir) / "model.safetensors")).items(), kinds)


def hf_logprobs(model_dir: str, prompt: list[int], completion: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    picked = logprobs.gather(1, targets[:, None])[:, 0]
    return picked[len(prompt) - 1 :].tolist()


async def main(student: str, teacher: str) -> dict[str, object]:
    engines = [
        EngineActor.options(num_cpus=1, resources={node: 0.01}, max_concurrency=1000).remote(  # type: ignore[attr-defined]
            tiny_engine_config(Path(student)), f"student-on-{node}"
        )
        for node in ("node_b", "node_a")
    ]
    await asyncio.gather(*(engine.start.remote() for engine in engines))
    group = EngineGroup(engines)
    holder = WeightHolder.remote(teacher)  # type: ignore[attr-defined]
    holder_node = await holder.node_id.remote()
    engine_nodes = await group.locate()
    result: dict[str, object] = {"nodes": [node == holder_node for node in engine_nodes]}
    kinds = await group.transfers("auto", holder_node)
    result["auto"] = kinds
    try:
        await group.transfers("shm", holder_node)
        result["shm_refused"] = False
    except ValueError as exc:
        result["shm_refused"] = "node" in str(exc)

    [completion] = await engines[0].generate_many.remote(
        [[1, 5, 9, 14, 30, 41]], max_tokens=16, temperature=1.0, seed=3
    )
    pair = (list(completion.prompt_token_ids), list(completion.completion_token_ids))
    before = [(await engine.score_many.remote([pair]))[0] for engine in engines]
    handoffs = await holder.export.remote(kinds)
    await group.update_weights([handoffs[kind] for kind in kinds], version=7)
    release_weights(handoffs.values())
    after = [(await engine.score_many.remote([pair]))[0] for engine in engines]
    teacher_scores = hf_logprobs(teacher, *pair)

    def gap(scores: list[float]) -> float:
        return max(abs(a - b) for a, b in zip(scores, teacher_scores, strict=True))

    result["versions"] = [await engine.weight_version.remote() for engine in engines]
    result["tokens"] = len(pair[1])
    result["before_vs_teacher"] = [gap(scores) for scores in before]
    result["after_vs_teacher"] = [gap(scores) for scores in after]
    await asyncio.gather(*(engine.shutdown.remote() for engine in engines))
    return result


if __name__ == "__main__":
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1}})
    cluster.add_node(num_cpus=2, resources={"node_b": 1})
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
    finally:
        session_dir = Path(cluster.head_node.get_session_dir_path())
        ray.shutdown()
        cluster.shutdown()
        remove_runtime_resources(session_dir)
