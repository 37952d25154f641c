"""Rollouts through the worker pool + recording gateway vs raw engine `generate`, side by side.

- throughput: completion tokens/s of a step's rollouts (`--prompts` × `--n-rollouts`, the example
  job's shape) run as the job driver runs them (`RolloutRunner`: a key per rollout, then a one-call
  rollout processor in the rollout pool: OpenAI client → gateway → engine, tokens recorded; the gateway
  in the engine's process, as a job places it: `rollout/gateway_placement.py`) over the
  engine actor's `generate` called directly with the same sampling settings and seeds (target >= 0.9);
  also the built-in rollout of Model OPD jobs (the driver's own request to the gateway, no pool). Each
  path gets fresh training prompts every round, so the gateway renders each prompt group once, as in
  a job, and never reuses a render from an earlier round;
- CPU: milliseconds of CPU each process on the path (driver, rollout worker, the sandboxed processor
  it runs, engine actor with the gateway in it, vLLM's engine core) spends per rollout on each path
  (median of the rounds);
- where a pool round's time goes (`pool_timeline_ms`, median of the rounds; each round's median and
  slowest rollout): from the round's start until the processor's `process` begins (the driver's call,
  the worker, the sandbox's pipe and event loop), the HTTP leg (the processor's client call minus
  the gateway's own time: client, relays, the gateway's HTTP server, both ways), and the gateway's
  time from a request's arrival to its answer (render, engine, record). Read from the processor's
  trace spans (`llm.call`) and the recorded call's `latency_s`; one clock (one machine). Beside it,
  the CPU of every process on the pool path but the engine's (whose figure holds the gateway's), in
  cores kept busy over the round (`pool_chain_cpu_cores`): with the engine's thread on one core, what
  the chain leaves of the others;
- overhead: per-call latency of a 1-token completion through the gateway (HTTP + chat template +
  recording) minus the same request sent straight to the engine actor, in milliseconds.

Launch: `.venv/bin/python benchmarks/rollout_gateway.py` (after `opd make-tiny-models`). On a CUDA box:
`--device cuda --models-dir .cache/gpu-models` (the random 0.5B pair of `benchmarks/make_random_model.py`;
see `benchmarks/gpu_check.sh`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import httpx
import psutil
from make_random_model import open_models_dir
from transformers import AutoTokenizer

from opd_trainer.chat import prompt_token_ids
from opd_trainer.cluster.ray_runtime import init_ray
from opd_trainer.demo.tiny_models import build_tiny_models
from opd_trainer.engine.fleet import start_replicas, stop_replicas
from opd_trainer.engine.vllm_engine import EngineConfig, EngineGroup
from opd_trainer.jobspec.dataset import Sample
from opd_trainer.jobspec.job_spec import FunctionComponent
from opd_trainer.jsonl import read_jsonl
from opd_trainer.rollout.gateway import RolloutKeyRequest
from opd_trainer.rollout.gateway_placement import place_gateways
from opd_trainer.rollout.runner import RolloutRunner
from rollout_workers.pool import RolloutPool

ONE_CALL_ROLLOUT = """
from opd_trainer.sdk import AbstractRolloutProcessor, AgentOutput, RolloutOutput


class OneCall(AbstractRolloutProcessor):
    async def process(self, rollout_input):
        resource = rollout_input.model_resource
        client = resource.openai_client()
        params = rollout_input.sampling_params
        reply = await client.chat.completions.create(
            model=resource.model_name, messages=rollout_input.messages, tools=rollout_input.tools,
            max_tokens=params["max_tokens"], seed=params["seed"])
        return RolloutOutput(agent_output=AgentOutput(
            messages=[*rollout_input.messages, reply.choices[0].message.model_dump(exclude_none=True)]))
"""


# The processes on a rollout's path, by the title Ray / vLLM give them (None: this process, the runner
# as the job driver runs it). The gateway runs in the engine actor's process; on a CPU node so does the
# engine core (`engine/inproc_llm.py`): no "engine core" process is found, and the actor's figure holds
# all three.
PROCESS_TITLES = {
    "driver": None,
    "rollout worker": "ray::ProcessorWorker",
    "engine actor": ("ray::StudentEngine", "ray::Engine"),  # the latter: code before role-named engines
    "engine core": "VLLM::EngineCore",
}
# The engine's processes; every other one on the pool path (driver, worker, sandbox) is "the chain",
# whose CPU is reported in cores kept busy over a round (`pool_chain_cpu_cores`).
ENGINE_PROCESSES = ("engine actor", "engine core")
# The user's processor runs in a sandboxed child process tree of the rollout worker (limits launcher,
# bubblewrap, `processor_host`): counted as one figure.
SANDBOX = "sandbox"


class ProcessCpu:
    """CPU seconds used so far by each process of `PROCESS_TITLES`, and by the rollout worker's
    sandboxed children together (`SANDBOX`)."""

    def __init__(self) -> None:
        found: dict[str, list[psutil.Process]] = {"driver": [psutil.Process()]}
        for process in psutil.process_iter(["cmdline"]):
            command = " ".join(process.info["cmdline"] or [])
            for name, title in PROCESS_TITLES.items():
                if title is not None and command.startswith(title):
                    found[name] = [process]
        if "rollout worker" in found:
            found[SANDBOX] = found["rollout worker"][0].children(recursive=True)
        self.processes = found

    def seconds(self) -> dict[str, float]:
        return {name: sum(_cpu_s(p) for p in group) for name, group in self.processes.items()}

    def per_call_ms(self, before: dict[str, float], calls: int) -> dict[str, float]:
        now = self.seconds()
        return {name: 1000 * (now[name] - before[name]) / calls for name in now}


def _cpu_s(process: psutil.Process) -> float:
    """User + system CPU seconds of `process` (0 once it is gone)."""
    try:
        return sum(process.cpu_times()[:2])
    except psutil.Error:
        return 0.0


def pool_timeline(results: list[Any], started_wall: float, seconds: float) -> dict[str, float]:
    """Where a pool round's time went, in ms (module docstring): each stage's median over the round's
    rollouts and its slowest, from each rollout's processor span, its `llm.call` span and the
    gateway's `latency_s` for that call."""
    to_processor, http, gateway = [], [], []
    for result in results:
        [call] = result.calls  # the one-call processor
        spans = {span["name"]: span for span in result.spans}
        client = spans["llm.call"]
        [processor] = [span for span in result.spans if span["parent_span_id"] is None]
        to_processor.append(processor["start_ns"] / 1e9 - started_wall)
        http.append((client["end_ns"] - client["start_ns"]) / 1e9 - call.latency_s)
        gateway.append(call.latency_s)
    timeline = {"round": 1000 * seconds}
    for name, values in (("to_processor", to_processor), ("http", http), ("gateway", gateway)):
        timeline[f"{name}_p50"] = 1000 * statistics.median(values)
        timeline[f"{name}_max"] = 1000 * max(values)
    return timeline


def engine_config(model_dir: Path, device: str) -> EngineConfig:
    # The engine is alone on the GPU (both sides of the comparison go through it): vLLM sizes its cache.
    return harness.engine_config(model_dir, device)


async def run(
    models_dir: Path,
    num_prompts: int,
    n_rollouts: int,
    max_tokens: int,
    rounds: int,
    overhead_calls: int,
    device: str = "cpu",
) -> dict[str, Any]:
    models = build_tiny_models(models_dir) if device == "cpu" else open_models_dir(models_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(models.student))
    records = read_jsonl(models.data_dir / "train.jsonl")
    # Every path samples prompts of its own each round, as a job's step does: the gateway has rendered
    # none of them before (it renders a prompt group's prompt once for its n_rollouts calls).
    batches = (records[i : i + num_prompts] for i in range(0, len(records), num_prompts))
    num_rollouts = num_prompts * n_rollouts
    seeds = list(range(num_rollouts))

    init_ray()
    config = engine_config(models.student, device)
    [engine], _ = await start_replicas(config, "bench")
    max_len = 1024 if device == "cpu" else config.max_model_len
    # The job's gateways, with the student's only (as a job that does not validate), where a job puts
    # them: in the student engine's process.
    options = {"max_tokens": max_tokens, "temperature": 1.0, "max_length": max_len}
    student = EngineGroup([engine])
    placed = await place_gateways({"student": str(models.student)}, options, student, None)
    gateway = placed.ref("student")
    base_url = await placed.serve("student", student)
    workspace = Path(tempfile.mkdtemp(prefix="opd-bench-ws-"))
    (workspace / "functions").mkdir()
    (workspace / "functions" / "__init__.py").write_text("")
    (workspace / "functions" / "one_call.py").write_text(ONE_CALL_ROLLOUT)
    component = FunctionComponent.model_validate(
        {
            "name": "bench",
            "type": "rollout",
            "fcmodel": {"zipdir": str(workspace), "classpath": "functions.one_call.OneCall"},
            "runtime": {
                "cpu": 0.5,
                "concurrency": num_rollouts,
                "capacity": 1,
                "min_capacity": 1,
                "max_capacity": 1,
            },
        }
    )
    pool = RolloutPool("bench", component, workspace)
    await pool.start()

    agentic = RolloutRunner(
        "bench", gateway, base_url, max_tokens=max_tokens, temperature=1.0, rollout_pool=pool
    )
    builtin = RolloutRunner("bench", gateway, base_url, max_tokens=max_tokens, temperature=1.0)

    timelines: list[dict[str, float]] = []

    async def through(runner: RolloutRunner) -> float:
        """A step's rollouts as the job driver runs them (keys, pool or built-in call, recorded calls)."""
        samples = [
            Sample(source="train.jsonl", line=i, messages=r["messages"], tools=r["tools"])
            for i, r in enumerate(next(batches))
        ]
        started, started_wall = time.perf_counter(), time.time()
        results = await runner.run(samples, n_rollouts, 0, seeds)
        seconds = time.perf_counter() - started
        failed = [r.error for r in results if r.failed]
        if failed:
            raise RuntimeError(f"{len(failed)} rollouts failed, first: {failed[0]}")
        if runner is agentic:
            timelines.append(pool_timeline(results, started_wall, seconds))
        return sum(len(c.completion_token_ids) for r in results for c in r.calls) / seconds

    async def raw() -> float:
        batch = next(batches)
        rendered = [prompt_token_ids(tokenizer, r["messages"], r["tools"]) for r in batch]
        prompts = [ids for ids in rendered for _ in range(n_rollouts)]
        started = time.perf_counter()
        completions = await asyncio.gather(
            *(
                engine.generate.remote(p, max_tokens=max_tokens, temperature=1.0, seed=s)
                for p, s in zip(prompts, seeds, strict=True)
            )
        )
        return sum(len(c.completion_token_ids) for c in completions) / (time.perf_counter() - started)

    await raw()
    await through(agentic)  # warm every path
    await through(builtin)
    processes = ProcessCpu()
    timelines.clear()  # the warm-up round's is not measured
    pooled, direct, plain = [], [], []
    cpu: dict[str, list[dict[str, float]]] = {"raw": [], "pool": [], "builtin": []}
    chain_cores: list[float] = []  # the pool path's CPU outside the engine, in cores busy over the round
    for _ in range(rounds):
        for path, runs, measure in (
            ("raw", direct, raw),
            ("pool", pooled, lambda: through(agentic)),
            ("builtin", plain, lambda: through(builtin)),
        ):
            before = processes.seconds()
            runs.append(await measure())
            cpu[path].append(processes.per_call_ms(before, num_rollouts))
            if path == "pool":
                chain_ms = sum(ms for name, ms in cpu[path][-1].items() if name not in ENGINE_PROCESSES)
                chain_cores.append(chain_ms * num_rollouts / timelines[-1]["round"])

    # Per-call overhead: the same 1-token request via HTTP gateway vs straight to the engine actor.
    [key] = await gateway.open_rollouts([RolloutKeyRequest("overhead")])
    overhead_prompt = prompt_token_ids(tokenizer, records[0]["messages"], records[0]["tools"])
    body = {
        "model": "student",
        "messages": records[0]["messages"],
        "tools": records[0]["tools"],
        "max_tokens": 1,
    }
    gateway_ms, engine_ms = [], []
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(overhead_calls):
            started = time.perf_counter()
            response = await client.post(
                f"{base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            response.raise_for_status()
            gateway_ms.append(1000 * (time.perf_counter() - started))
            started = time.perf_counter()
            await engine.generate.remote(overhead_prompt, max_tokens=1, temperature=1.0)
            engine_ms.append(1000 * (time.perf_counter() - started))
    await agentic.close()
    await builtin.close()
    await pool.shutdown()
    await stop_replicas([engine])  # the gateway with it

    pooled_tps, raw_tps, builtin_tps = (
        statistics.median(pooled),
        statistics.median(direct),
        statistics.median(plain),
    )
    return {
        "prompts": num_prompts,
        "n_rollouts": n_rollouts,
        "max_tokens": max_tokens,
        "pool_gateway_tokens_per_s": pooled_tps,
        "builtin_gateway_tokens_per_s": builtin_tps,
        "raw_engine_tokens_per_s": raw_tps,
        "throughput_ratio": pooled_tps / raw_tps,
        "builtin_throughput_ratio": builtin_tps / raw_tps,
        "throughput_target": 0.9,
        "cpu_ms_per_rollout": {
            path: {name: statistics.median(r[name] for r in runs) for name in runs[0]}
            for path, runs in cpu.items()
        },
        "pool_timeline_ms": {name: statistics.median(t[name] for t in timelines) for name in timelines[0]},
        "pool_chain_cpu_cores": statistics.median(chain_cores),
        "gateway_call_ms_p50": statistics.median(gateway_ms),
        "engine_call_ms_p50": statistics.median(engine_ms),
        "gateway_overhead_ms_p50": statistics.median(gateway_ms) - statistics.median(engine_ms),
    }


def format_table(result: dict[str, Any]) -> str:
    rows = [
        ("tokens/s via rollout pool + gateway", f"{result['pool_gateway_tokens_per_s']:.0f}"),
        ("tokens/s via built-in rollout + gateway", f"{result['builtin_gateway_tokens_per_s']:.0f}"),
        ("tokens/s via raw engine generate", f"{result['raw_engine_tokens_per_s']:.0f}"),
        ("ratio, pool (target >= 0.90)", f"{result['throughput_ratio']:.2f}"),
        ("ratio, built-in (Model OPD)", f"{result['builtin_throughput_ratio']:.2f}"),
        ("1-token call via gateway, ms (p50)", f"{result['gateway_call_ms_p50']:.1f}"),
        ("same call straight to engine, ms", f"{result['engine_call_ms_p50']:.1f}"),
        ("gateway overhead per call, ms", f"{result['gateway_overhead_ms_p50']:.1f}"),
    ]
    timeline = result["pool_timeline_ms"]
    rows.append(
        (
            "pool round, ms (median / slowest rollout)",
            f"round {timeline['round']:.0f}  "
            + "  ".join(
                f"{name} {timeline[f'{name}_p50']:.0f}/{timeline[f'{name}_max']:.0f}"
                for name in ("to_processor", "http", "gateway")
            ),
        )
    )
    rows.append(("pool path's CPU outside the engine, cores busy", f"{result['pool_chain_cpu_cores']:.2f}"))
    for path, usage in result["cpu_ms_per_rollout"].items():
        rows.append((f"CPU ms a rollout, {path}", "  ".join(f"{k} {v:.1f}" for k, v in usage.items())))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value:>8}" for name, value in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path(".cache/tiny-models"))
    parser.add_argument("--prompts", type=int, default=16, help="prompts a round (fresh ones every round)")
    parser.add_argument("--n-rollouts", type=int, default=4, help="rollouts of each prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--overhead-calls", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/rollout_gateway.json"))
    harness.add_device_argument(parser, "KV cache sized by vLLM")
    args = parser.parse_args()
    harness.check_device(parser, args.device)
    result = asyncio.run(
        run(
            args.models_dir,
            args.prompts,
            args.n_rollouts,
            args.max_tokens,
            args.rounds,
            args.overhead_calls,
            args.device,
        )
    )
    print(format_table(result))
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
