"""Run by `test_multi_node.py` in its own process: a two-node Ray cluster on this machine.

Node A holds the weights (put in Ray's object store there, as the learner does), node B runs the
student engine. `auto` must pick the object store for that engine, `shm` must be refused, and after
the update the engine on node B scores like the teacher whose weights were sent. Prints one JSON line.
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

from opd_trainer.demo.tiny_models.serving import tiny_engine_config
from opd_trainer.engine.vllm_engine import EngineActor, EngineGroup
from opd_trainer.engine.weight_sync import put_object_store_weights


@ray.remote(num_cpus=0, resources={"node_a": 0.01})
class WeightHolder:
    """Stands where the learner stands: owns the object-store copy of the weights it exports."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def export(self) -> object:
        return put_object_store_weights(load_file(str(Path(self.model_dir) / "model.safetensors")).items())


def hf_logprobs(model_dir: str, prompt: list[int], completion: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    picked = logprobs.gather(1, targets[:, None])[:, 0]
    return picked[len(prompt) - 1 :].tolist()


async def main(student: str, teacher: str) -> dict[str, object]:
    engine = EngineActor.options(num_cpus=1, resources={"node_b": 0.01}, max_concurrency=1000).remote(  # type: ignore[attr-defined]
        tiny_engine_config(Path(student)), "student-on-b"
    )
    await engine.start.remote()
    group = EngineGroup([engine])
    holder = WeightHolder.remote(teacher)  # type: ignore[attr-defined]
    holder_node = await holder.node_id.remote()
    [engine_node] = await group.locate()
    result: dict[str, object] = {"different_nodes": holder_node != engine_node}
    result["auto"] = await group.transfers("auto", holder_node)
    try:
        await group.transfers("shm", holder_node)
        result["shm_refused"] = False
    except ValueError as exc:
        result["shm_refused"] = "node" in str(exc)

    [completion] = await engine.generate_many.remote(
        [[1, 5, 9, 14, 30, 41]], max_tokens=16, temperature=1.0, seed=3
    )
    prompt, tokens = list(completion.prompt_token_ids), list(completion.completion_token_ids)
    before = (await engine.score_many.remote([(prompt, tokens)]))[0]
    handoff = await holder.export.remote()
    await group.update_weights([handoff], version=7)
    after = (await engine.score_many.remote([(prompt, tokens)]))[0]
    teacher_scores = hf_logprobs(teacher, prompt, tokens)
    result["version"] = await engine.weight_version.remote()
    result["tokens"] = len(tokens)
    result["before_vs_teacher"] = max(abs(a - b) for a, b in zip(before, teacher_scores, strict=True))
    result["after_vs_teacher"] = max(abs(a - b) for a, b in zip(after, teacher_scores, strict=True))
    await engine.shutdown.remote()
    return result


if __name__ == "__main__":
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1}})
    cluster.add_node(num_cpus=2, resources={"node_b": 1})
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
    finally:
        ray.shutdown()
        cluster.shutdown()
