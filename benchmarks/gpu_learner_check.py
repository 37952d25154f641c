"""What the project can check on one GPU without vLLM or Ray: the learner's step, the loss kernels, a
CUDA-IPC weight handoff between two processes and the memory plan, in one call of under 8 minutes.

    .venv/bin/python benchmarks/gpu_learner_check.py                     # one CUDA GPU, Qwen2.5-0.5B shape
    .venv/bin/python benchmarks/gpu_learner_check.py --device cpu --size small --vocab-size 1024 \
        --prompt-tokens 32 --max-new-tokens 16 --budget-s 240                           # CPU smoke, ~1 min

Needs torch, transformers and this repo (no download: the model is built in-process from
`make_random_model.py`'s Qwen2.5-0.5B shape with random weights); PEFT for the LoRA variants; DeepSpeed
for part `deepspeed` (the real `Learner`; Ray is replaced by an import-only stand-in when it is missing,
as on the lent GPU machine). `--block-imports ray,vllm,deepspeed` makes this machine look like that one.

Parts (`--parts`; each in its own try/except, its error recorded, the others still run; a global
`--budget-s` skips what no longer fits, with a note):

1. `learner`: one optimizer update as `Learner._update` does it (`learner/batch.py`: `pad_segments`,
   the shared-prefix `scored_logits`, `logprobs_of_targets`; `estimators.distillation_loss`), with
   torch AdamW (fused on CUDA) over the trainable parameters and gradient clipping, on
   `learner_step.py`'s batch shape (`--rows` completions, `--n-rollouts` a prompt, lengths 1 to
   `--max-new-tokens`, the teacher's top-k) with random prompts sharing a preamble. Four variants:
   full / LoRA (PEFT, r 16, alpha 32, every projection) × gradient checkpointing off / on. Per variant:
   median step time of `--steps` after `--warmup`, peak memory (CUDA `max_memory_allocated`, reset per
   variant; CPU: the peak RSS above the RSS before the model was built, `VmHWM` reset per variant),
   parameters, trainable parameters and peak bytes per parameter. The dtype is the Learner's: bf16 on
   CUDA, fp32 on CPU (`--dtype` overrides).
2. `losses`: every estimator of `ESTIMATORS` on a random batch whose teacher top-k is a real
   distribution: loss and gradient w.r.t. the logits on `--device` in fp32, and with bf16 inputs, against
   the same functions in float64 on CPU; max abs / normwise relative errors with the thresholds in the
   record (`LOSS_THRESHOLDS`).
3. `ipc`: process A (this one, the learner) packs the student's named tensors bucket by bucket into one
   reused flat buffer (`weight_sync.buckets.pack_bucket`), shares it once (`weight_sync.gpu`
   `share_cuda_buffer`, i.e. `reduce_tensor`; on CPU a shared-memory tensor through the queue) and sends
   each bucket's entries through a `torch.multiprocessing` queue; process B (a transformers model of the
   same shape with other weights, standing in for the engine) opens it, `unpack_bucket`s the views and
   copies them into its parameters, acknowledging each bucket. Both then compare parameter checksums
   and logits on one input. GB/s = model bytes / (first pack to last acknowledgement), median of rounds.
4. `deepspeed`: the real `Learner` (world size 1, ZeRO `--zero-stage`) on the same batch and variants,
   from the model saved to a temporary folder; whether it applied LoRA / checkpointing is recorded.
5. `plan`: `jobspec.memory_plan.learner_plan` of each variant's job settings against its measured peak
   (target |plan − measured| / measured <= 0.2). For the plain-torch step the plan's DeepSpeed terms are
   also shown without the fp32 master and with AdamW's moments in the parameter dtype (what torch AdamW
   holds); the DeepSpeed rows compare like with like.

Writes `--out` (JSON) and prints one table. Not yet run on a GPU in this project (see
docs/benchmarks.md, "GPU learner check").
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import importlib
import importlib.abc
import importlib.util
import json
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
# The repo and this folder: the GPU machine runs this file from a copy of the tree, not installed.
sys.path[:0] = [str(BENCHMARKS), str(REPO)]

from learner_step import segments  # noqa: E402
from make_random_model import QWEN25_VOCAB, make_config, qwen25_05b_shape, small_shape  # noqa: E402

PARTS = ("learner", "losses", "ipc", "deepspeed", "plan")
VARIANTS = (
    ("full", False, False),
    ("full+ckpt", False, True),
    ("lora", True, False),
    ("lora+ckpt", True, True),
)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_R, LORA_ALPHA = 16, 32
# Special ids of the random model's config (no tokenizer is used here).
SPECIAL_IDS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}
PLAN_TARGET = 0.2
MIB = 2**20
MIN_PART_S = 15.0
"""A part (or a variant) does not start with less of the budget left."""

LOSS_THRESHOLDS = {
    # fp32 on the device against fp64 on CPU: float32 rounding only (loss and gradient in normwise terms).
    "fp32": {"loss_rel": 1e-4, "grad_rel": 1e-4},
    # bf16 inputs (logits, teacher and sampler logprobs rounded as the learner's bf16 model emits them), the
    # loss functions' own float32 upcast, against fp64 of the same rounded inputs: the kernels' error. The
    # gradient w.r.t. bf16 logits is itself bf16 (relative rounding up to 2^-8 = 3.9e-3).
    "bf16_kernel": {"loss_rel": 1e-3, "grad_rel": 1e-2},
}
BF16_TOTAL_BOUNDS = {"loss_rel": 5e-2, "grad_rel": 0.2}
"""Sanity bounds, not pass criteria, of bf16 against fp64 of the unrounded inputs (`bf16_total`): a
logit x in bf16 is off by up to |x|·2^-9 (0.03 at |x| = 15), so probabilities move by up to ~3 % and the
gradient p − q relatively more where the student is close to the teacher. Input sensitivity, not a
kernel's error; reported so that a GPU run can be compared with this CPU one."""


# -- set-up ------------------------------------------------------------------------------------------


def block_imports(names: list[str]) -> None:
    """Makes `import name` (and its submodules) fail, as on a machine without the package."""
    for name in names:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[loaded]
        sys.modules[name] = None  # type: ignore[assignment]


class _RayStub:
    """Any attribute, call or decoration of the stand-in `ray` answers itself (import-time use only)."""

    def __getattr__(self, name: str) -> _RayStub:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> _RayStub:
        return self


class _RayStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname == "ray" or fullname.startswith("ray."):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__getattr__ = lambda name: _RayStub()  # type: ignore[method-assign]
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def stub_ray_if_missing() -> str:
    """Lets `deepspeed_learner` import where Ray is not installed: a world-size-1 `Learner` given its
    rendezvous address calls no Ray function. Returns what was done, for the record."""
    try:
        import ray  # noqa: F401
    except ImportError:
        sys.modules.pop("ray", None)
        sys.meta_path.insert(0, _RayStubFinder())
        return "stubbed: ray is not installed; an import-only stand-in (no Ray call is made at world size 1)"
    return "installed"


def load_weight_sync() -> tuple[Any, Any, str]:
    """The weight-sync pack/unpack (`buckets`) and CUDA-handle (`gpu`) modules. The package's
    `__init__` imports Ray (its host-memory transports); without Ray the two modules, which need only
    torch, are loaded from their files. None, None when they are not there."""
    try:
        # By module: the package re-exports a function named `buckets`.
        buckets = importlib.import_module("opd_trainer.weight_sync.buckets")
        gpu = importlib.import_module("opd_trainer.weight_sync.gpu")
        return buckets, gpu, "opd_trainer.weight_sync"
    except ImportError as error:
        why = str(error)
    folder = REPO / "opd_trainer" / "weight_sync"
    loaded = []
    for name in ("buckets", "gpu"):
        path = folder / f"{name}.py"
        if not path.is_file():
            return None, None, f"no {path} ({why})"
        spec = importlib.util.spec_from_file_location(f"_gpu_learner_check_{name}", path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[spec.name] = module  # type: ignore[union-attr]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        loaded.append(module)
    return loaded[0], loaded[1], f"weight_sync/buckets.py and gpu.py by path (package import failed: {why})"


def model_config(args: argparse.Namespace) -> Any:
    shape = (small_shape if args.size == "small" else qwen25_05b_shape)(
        args.layers or (2 if args.size == "small" else 24)
    )
    vocab = args.vocab_size or (1024 if args.size == "small" else QWEN25_VOCAB)
    max_positions = max(4096, args.prompt_tokens * 2 + args.max_new_tokens + 8)
    return make_config(shape, vocab, max_positions, SPECIAL_IDS)


def build_model(config: Any, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    """A randomly initialised student, built on `device` in `dtype` (no fp32 copy on the host)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.config.use_cache = False
    return model


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` prompts sharing a preamble of half of `length` tokens, with tails of different lengths
    (a system + tools preamble, then the user's turn)."""
    rng = np.random.default_rng(seed)
    preamble = rng.integers(3, vocab, size=max(1, length // 2)).tolist()
    return [
        preamble
        + rng.integers(3, vocab, size=int(rng.integers(max(1, length // 4), length // 2 + 2))).tolist()
        for _ in range(count)
    ]


def learner_batch(args: argparse.Namespace, vocab: int) -> list[Any]:
    prompts = random_prompts(args.rows // args.n_rollouts, args.prompt_tokens, vocab, seed=0)
    return segments(prompts, args.n_rollouts, args.max_new_tokens, args.teacher_top_k, vocab)


def distillation_settings(args: argparse.Namespace, estimator: str | None = None) -> Any:
    from opd_trainer.learner.estimators import DistillationSettings

    return DistillationSettings(
        distill_loss=estimator or args.estimator,
        teacher_top_k=args.teacher_top_k,
        kl_coef=1.0,
        jsd_beta=0.5,
        ratio_cap=10.0,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cpu" and sys.platform == "linux":
        # glibc keeps freed heap pages: without this the next variant's baseline RSS would include them.
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()


class PeakMemory:
    """Peak memory of what runs between `start` and `peak`: CUDA's allocator peak, or on CPU the peak
    RSS (Linux `VmHWM`, reset at `start`; elsewhere `ru_maxrss`, never reset: a lower bound) above the
    RSS at `start`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.method = ""
        self.base = 0

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def start(self) -> None:
        free_memory(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            self.method = "torch.cuda.max_memory_allocated - memory_allocated before the model"
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.base = self._status("VmRSS")
            self.method = "VmHWM (reset per variant) - VmRSS before the model"
        except OSError:
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            self.method = "ru_maxrss delta (not resettable: a lower bound)"

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        if self.method.startswith("VmHWM"):
            return self._status("VmHWM") - self.base
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.base


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


# -- 1. learner step ---------------------------------------------------------------------------------


def apply_variant(model: Any, lora: bool, checkpointing: bool) -> Any:
    if checkpointing:
        # Non-reentrant: no input needs requires_grad (frozen embeddings under LoRA).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
        )
        model = get_peft_model(model, config)
    model.train()
    return model


def torch_update(
    model: Any,
    optimizer: Any,
    trainable: list[Any],
    batch_segments: list[Any],
    settings: Any,
    forward: str,
    device: torch.device,
) -> float:
    """`Learner._update` with torch in place of DeepSpeed: forward, estimator loss, backward, clip, step."""
    from opd_trainer.learner.batch import logprobs_of_targets, pad_segments, prefix_plan, scored_logits
    from opd_trainer.learner.estimators import distillation_loss

    batch = pad_segments(batch_segments, settings.teacher_top_k, device)
    plan = prefix_plan(batch) if forward == "shared_prefix" else None
    logits_B_S_V = scored_logits(model, batch, plan, device)
    learner_B_T = logprobs_of_targets(logits_B_S_V, batch, 1.0)
    loss, _ = distillation_loss(settings, batch.distillation_inputs(logits_B_S_V, learner_B_T, None, None))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _recorded(out: list[Any], function: Callable[..., Any], *args: Any) -> None:
    out.append(function(*args))


def timed_steps(step: Callable[[], Any], device: torch.device, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    sync(device)
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        sync(device)  # the step's kernels are asynchronous: time them, not their launch
        seconds.append(time.perf_counter() - started)
    return seconds


def variant_forward(forward: str, checkpointing: bool) -> str:
    """`--forward auto`: the Learner's shared-prefix forward, but the padded one under gradient
    checkpointing, where transformers drops the KV cache (`use_cache=False` in training) that the
    shared-prefix forward passes from one level to the next."""
    if forward != "auto":
        return forward
    return "padded" if checkpointing else "shared_prefix"


def run_torch_variant(
    args: argparse.Namespace,
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
    batch: list[Any],
    lora: bool,
    checkpointing: bool,
) -> dict[str, Any]:
    memory = PeakMemory(device)
    memory.start()
    model = apply_variant(build_model(config, dtype, device, seed=0), lora, checkpointing)
    parameters = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_count = sum(p.numel() for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, weight_decay=0.0, fused=device.type == "cuda")
    forward = variant_forward(args.forward, checkpointing)
    losses: list[float] = []
    step = functools.partial(
        _recorded,
        losses,
        torch_update,
        model,
        optimizer,
        trainable,
        batch,
        distillation_settings(args),
        forward,
        device,
    )
    del model, optimizer, trainable  # held by `step` alone, freed with it
    try:
        seconds = timed_steps(step, device, args.warmup, args.steps)
        peak = memory.peak()
    finally:
        del step
        free_memory(device)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "forward": forward,
        "step_s": statistics.median(seconds),
        "step_all_s": seconds,
        "peak_bytes": peak,
        "peak_method": memory.method,
        "parameters": parameters,
        "trainable_parameters": trainable_count,
        "bytes_per_parameter": peak / parameters,
        "losses": losses,
        "finite": all(math.isfinite(v) for v in losses),
    }


def part_learner(args: argparse.Namespace, ctx: dict[str, Any], budget: Budget) -> dict[str, Any]:
    device, dtype, config = ctx["device"], ctx["dtype"], ctx["config"]
    batch = learner_batch(args, config.vocab_size)
    out: dict[str, Any] = {
        "batch": {
            "rows": len(batch),
            "prompt_tokens": [len(s.prompt_token_ids) for s in batch[:: args.n_rollouts]],
            "completion_tokens": [len(s.completion_token_ids) for s in batch],
            "teacher_top_k": args.teacher_top_k,
            "estimator": args.estimator,
        },
        "optimizer": f"torch.optim.AdamW(fused={device.type == 'cuda'}), grad clip 1.0, moments in {dtype}",
        "variants": {},
    }
    if device.type == "cpu":
        # One unmeasured update first: the first backward on CPU grows the process by one-time buffers
        # (thread pools, kernels) that would land in the first variant's RSS peak. CUDA's allocator
        # peak does not see those.
        prewarm = argparse.Namespace(**{**vars(args), "warmup": 0, "steps": 1})
        run_torch_variant(prewarm, config, device, dtype, batch, lora=False, checkpointing=False)
        out["cpu_prewarm"] = "one unmeasured full update before the variants"
    for name, lora, checkpointing in VARIANTS:
        if budget.left() < MIN_PART_S:
            out["variants"][name] = {"status": "skipped", "note": f"{budget.left():.0f}s of the budget left"}
            continue
        try:
            result = run_torch_variant(args, config, device, dtype, batch, lora, checkpointing)
            out["variants"][name] = {"status": "ok", **result}
        except Exception as error:  # one variant failing (PEFT missing, OOM) must not lose the others
            out["variants"][name] = {"status": "error", "error": _error(error)}
            free_memory(device)
    ctx["learner_variants"] = out["variants"]
    return out


# -- 2. loss kernels against fp64 --------------------------------------------------------------------


def loss_check_segments(args: argparse.Namespace, vocab: int) -> tuple[list[Any], torch.Tensor]:
    """Random completions with a consistent teacher (its top-k and token logprobs from one softmax) and
    the student logits [B, S, V] (fp32, seeded) their loss is computed on; sampler logprobs are the
    student's own plus noise (ratios near 1)."""
    from opd_trainer.records import LLMCall

    rng = np.random.default_rng(1)
    generator = torch.Generator().manual_seed(1)
    rows, width, k = args.loss_rows, args.loss_tokens, args.teacher_top_k
    lengths = [width] + [int(n) for n in rng.integers(1, width + 1, size=rows - 1)]
    logits_B_S_V = 3.0 * torch.randn(rows, width, vocab, generator=generator)
    teacher_B_S_V = torch.log_softmax(4.0 * torch.randn(rows, width, vocab, generator=generator), dim=-1)
    student_B_S_V = torch.log_softmax(logits_B_S_V.double(), dim=-1)
    calls = []
    prompt = rng.integers(3, vocab, size=8).tolist()
    for row, length in enumerate(lengths):
        completion = torch.multinomial(teacher_B_S_V[row, :length].exp(), 1, generator=generator).squeeze(-1)
        top_B_K = torch.topk(teacher_B_S_V[row, :length], k, dim=-1)
        student = student_B_S_V[row, torch.arange(length), completion]
        calls.append(
            LLMCall(
                prompt_token_ids=prompt,
                completion_token_ids=completion.tolist(),
                sampler_logprobs=(student + 0.1 * torch.randn(length, generator=generator).double()).tolist(),
                teacher_logprobs=teacher_B_S_V[row, torch.arange(length), completion].tolist(),
                teacher_top_ids=top_B_K.indices.numpy().astype(np.int32),
                teacher_top_logprobs=top_B_K.values.numpy().astype(np.float32),
                group_id=row // 2,
                rollout_id=row,
            )
        )
    return calls, logits_B_S_V


def loss_and_grad(
    calls: list[Any],
    logits_B_S_V: torch.Tensor,
    row_advantages_B: torch.Tensor,
    settings: Any,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[float, torch.Tensor]:
    """The estimator's loss and its gradient w.r.t. the logits, every float input in `dtype` on `device`
    (the loss functions upcast bf16 themselves, as in the learner)."""
    from opd_trainer.learner.batch import logprobs_of_targets, pad_segments
    from opd_trainer.learner.estimators import distillation_loss

    batch = pad_segments(calls, settings.teacher_top_k, device)
    as_dtype = {
        name: getattr(batch, name).to(dtype)
        for name in ("mask_B_T", "completion_mask_B_T", "sampler_B_T", "teacher_B_T", "top_logprobs_B_T_K")
    }
    batch = replace(batch, **as_dtype)
    # Padding after the longest completion: the batch scores exactly `loss_tokens` positions.
    logits = logits_B_S_V.to(device=device, dtype=dtype).requires_grad_(True)
    learner_B_T = logprobs_of_targets(logits, batch, 1.0)
    inputs = batch.distillation_inputs(
        logits, learner_B_T, row_advantages_B.to(device=device, dtype=dtype), None
    )
    loss, _ = distillation_loss(settings, inputs)
    (grad,) = torch.autograd.grad(loss, logits)
    return float(loss.detach().double()), grad.detach().double().cpu()


def compare(loss: float, grad: torch.Tensor, ref_loss: float, ref_grad: torch.Tensor) -> dict[str, float]:
    scale = float(ref_grad.abs().max()) or 1.0
    grad_abs = float((grad - ref_grad).abs().max())
    return {
        "loss": loss,
        "loss_abs": abs(loss - ref_loss),
        "loss_rel": abs(loss - ref_loss) / max(abs(ref_loss), 1e-12),
        "grad_abs": grad_abs,
        "grad_rel": grad_abs / scale,
        "finite": math.isfinite(loss) and bool(torch.isfinite(grad).all()),
    }


def part_losses(args: argparse.Namespace, ctx: dict[str, Any], budget: Budget) -> dict[str, Any]:
    from opd_trainer.learner.estimators import ESTIMATORS

    device, vocab = ctx["device"], ctx["config"].vocab_size
    calls, logits_B_S_V = loss_check_segments(args, vocab)
    row_advantages_B = torch.linspace(-1.0, 1.0, len(calls))
    rounded_calls = [
        replace(
            c,
            sampler_logprobs=torch.tensor(c.sampler_logprobs).bfloat16().double().tolist(),
            teacher_logprobs=torch.tensor(c.teacher_logprobs).bfloat16().double().tolist(),
            teacher_top_logprobs=torch.from_numpy(c.teacher_top_logprobs).bfloat16().float().numpy(),
        )
        for c in calls
    ]
    rounded_logits = logits_B_S_V.bfloat16().float()
    cpu = torch.device("cpu")
    out: dict[str, Any] = {
        "shape": {
            "rows": len(calls),
            "scored_positions": args.loss_tokens,
            "vocab": vocab,
            "top_k": args.teacher_top_k,
        },
        "thresholds": LOSS_THRESHOLDS,
        "bf16_total_bounds": BF16_TOTAL_BOUNDS,
        "errors": "loss_rel = |loss - ref| / |ref|; grad_rel = max|grad - ref| / max|ref| (w.r.t. logits)",
        "note": "learner/loss.py gather_token_logprobs upcasts with .float(): the reference's learner "
        "logprobs (the policy-gradient path) are float32 even in the float64 run",
        "estimators": {},
    }
    failures = []
    for name, estimator in ESTIMATORS.items():
        if budget.left() < 5:
            out["estimators"][name] = {"status": "skipped", "note": "out of budget"}
            continue
        settings = distillation_settings(args, name)
        try:
            ref = loss_and_grad(calls, logits_B_S_V, row_advantages_B, settings, cpu, torch.float64)
            ref_rounded = loss_and_grad(
                rounded_calls, rounded_logits, row_advantages_B, settings, cpu, torch.float64
            )
            fp32 = loss_and_grad(calls, logits_B_S_V, row_advantages_B, settings, device, torch.float32)
            bf16 = loss_and_grad(calls, logits_B_S_V, row_advantages_B, settings, device, torch.bfloat16)
            row = {
                "status": "ok",
                "needs_top_k": estimator.needs_top_k,
                "reference_loss": ref[0],
                "fp32": compare(*fp32, *ref),
                "bf16_kernel": compare(*bf16, *ref_rounded),
                "bf16_total": compare(*bf16, *ref),
            }
            row["bf16_total"]["within_bounds"] = all(
                row["bf16_total"][key] <= bound for key, bound in BF16_TOTAL_BOUNDS.items()
            )
            row["passed"] = all(
                row[mode]["finite"] and row[mode][key] <= limit
                for mode, limits in LOSS_THRESHOLDS.items()
                for key, limit in limits.items()
            )
            if not row["passed"]:
                failures.append(name)
            out["estimators"][name] = row
        except Exception as error:
            out["estimators"][name] = {"status": "error", "error": _error(error)}
            failures.append(name)
    out["passed"] = not failures
    out["failed"] = failures
    return out


# -- 3. CUDA-IPC handoff ---------------------------------------------------------------------------


def named_weights(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The state dict with tied tensors once (as `Learner.named_weights`)."""
    seen: set[int] = set()
    weights = []
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            weights.append((name, tensor.detach()))
    return weights


def checksum(weights: list[tuple[str, torch.Tensor]]) -> float:
    return float(sum(t.double().sum() + 0.5 * t.double().abs().sum() for _, t in weights))


def probe_ids(config: Any, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(3, config.vocab_size, (2, 16), generator=generator).to(device)


def ipc_receiver(
    config: Any, dtype: torch.dtype, device_name: str, blocked: list[str], inbox: Any, outbox: Any
) -> None:
    """Process B: the engine stand-in. Loads every bucket announced on `inbox` into its own model."""
    try:
        # The same imports as process A's: the bucket entries unpickle from the module A packed them with.
        block_imports(blocked)
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        buckets_module, gpu_module, _ = load_weight_sync()
        unpack = buckets_module.unpack_bucket if buckets_module else _unpack
        model = build_model(config, dtype, device, seed=1).eval()
        params = dict(model.state_dict())
        before = checksum(named_weights(model))
        outbox.put(("ready", before))
        flat = None
        while True:
            message = inbox.get()
            if message[0] == "buffer":
                handle = message[1]
                if device.type == "cuda":
                    flat = gpu_module.open_cuda_buffer(handle) if gpu_module else _open_cuda(handle)
                else:
                    flat = handle  # a shared-memory tensor, rebuilt by torch.multiprocessing
                outbox.put(("opened", None))
            elif message[0] == "bucket":
                entries = message[1]
                with torch.no_grad():
                    for name, view in unpack(flat, entries):
                        params[name].copy_(view)
                sync(device)  # the copies are done before A may overwrite the buffer
                outbox.put(("loaded", None))
            elif message[0] == "check":
                with torch.no_grad():
                    logits = model(input_ids=probe_ids(config, device)).logits.float().cpu()
                outbox.put(("checked", (checksum(named_weights(model)), logits)))
            elif message[0] == "stop":
                del flat
                outbox.put(("stopped", None))
                return
    except Exception as error:
        outbox.put(("error", _error(error)))


def _unpack(flat: torch.Tensor, entries: list[Any]) -> list[tuple[str, torch.Tensor]]:
    """`unpack_bucket` where weight_sync is missing: entries are (name, dtype, shape, offset, nbytes)."""
    return [
        (name, flat[offset : offset + nbytes].view(getattr(torch, dtype)).reshape(shape))
        for name, dtype, shape, offset, nbytes in entries
    ]


def _pack(bucket: list[tuple[str, torch.Tensor]], out: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
    """`pack_bucket` where weight_sync is missing (256-byte aligned offsets)."""
    entries, offset = [], 0
    for name, tensor in bucket:
        offset = -(-offset // 256) * 256
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        out[offset : offset + raw.numel()].copy_(raw)
        entries.append(
            (name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, raw.numel())
        )
        offset += raw.numel()
    return out[:offset], entries


def _open_cuda(handle: Any) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*handle)


def _buckets(
    weights: list[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _expect(outbox: Any, kind: str, timeout: float) -> Any:
    message = outbox.get(timeout=timeout)
    if message[0] == "error":
        raise RuntimeError(f"process B failed: {message[1]}")
    if message[0] != kind:
        raise RuntimeError(f"process B answered {message[0]!r}, expected {kind!r}")
    return message[1]


def part_ipc(args: argparse.Namespace, ctx: dict[str, Any], budget: Budget) -> dict[str, Any]:
    import torch.multiprocessing as mp

    device, dtype, config = ctx["device"], ctx["dtype"], ctx["config"]
    buckets_module, gpu_module, source = load_weight_sync()
    pack = buckets_module.pack_bucket if buckets_module else _pack
    split = buckets_module.buckets if buckets_module else _buckets
    model = build_model(config, dtype, device, seed=0).eval()
    weights = named_weights(model)
    total = sum(t.numel() * t.element_size() for _, t in weights)
    tensors = len(weights)
    bucket_bytes = args.bucket_mb * 1024 * 1024
    largest = max(t.numel() * t.element_size() for _, t in weights)
    buffer = torch.empty(max(bucket_bytes, largest) + 256 * len(weights), dtype=torch.uint8, device=device)
    if device.type == "cuda":
        if gpu_module:
            handle: Any = gpu_module.share_cuda_buffer(buffer)
        else:
            _, handle = torch.multiprocessing.reductions.reduce_tensor(buffer)
    else:
        buffer.share_memory_()
        handle = buffer
    spawn = mp.get_context("spawn")
    inbox, outbox = spawn.Queue(), spawn.Queue()
    receiver = spawn.Process(
        target=ipc_receiver,
        args=(config, dtype, str(device), blocked_imports(args), inbox, outbox),
        daemon=True,
    )
    wait = max(30.0, budget.left())
    started = time.perf_counter()
    receiver.start()
    try:
        b_before = _expect(outbox, "ready", wait)
        startup_s = time.perf_counter() - started
        opened = time.perf_counter()
        inbox.put(("buffer", handle))
        _expect(outbox, "opened", wait)
        open_s = time.perf_counter() - opened
        rounds = []
        n_buckets = 0
        for _ in range(args.ipc_rounds):
            sync(device)
            t0 = time.perf_counter()
            n_buckets = 0
            for bucket in split(weights, bucket_bytes):
                _, entries = pack(bucket, out=buffer)
                sync(device)  # B reads the buffer through another stream of another process
                inbox.put(("bucket", entries))
                _expect(outbox, "loaded", wait)
                n_buckets += 1
            rounds.append(time.perf_counter() - t0)
        inbox.put(("check",))
        b_after, b_logits = _expect(outbox, "checked", wait)
        with torch.no_grad():
            a_logits = model(input_ids=probe_ids(config, device)).logits.float().cpu()
        a_sum = checksum(weights)
        inbox.put(("stop",))
        _expect(outbox, "stopped", wait)
    finally:
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
        del model, weights, buffer
        free_memory(device)
    logits_diff = float((a_logits - b_logits).abs().max())
    median_s = statistics.median(rounds)
    return {
        "helpers": source,
        "transport": "CUDA IPC (one reused buffer, reduce_tensor handle)"
        if device.type == "cuda"
        else "shared-memory CPU tensor through a torch.multiprocessing queue (protocol check, not CUDA IPC)",
        "bytes": total,
        "tensors": tensors,
        "buckets": n_buckets,
        "bucket_mb": args.bucket_mb,
        "process_b_start_s": startup_s,
        "open_handle_s": open_s,
        "round_s": rounds,
        "gb_per_s": total / median_s / 1e9,
        "checksum_a": a_sum,
        "checksum_b_before": b_before,
        "checksum_b_after": b_after,
        "weights_changed": b_before != b_after,
        "checksums_equal": a_sum == b_after,
        "logits_max_abs_diff": logits_diff,
        "passed": a_sum == b_after and b_before != b_after and logits_diff <= 1e-3,
    }


# -- 4. the real Learner (DeepSpeed) ---------------------------------------------------------------


def job_spec(args: argparse.Namespace, model: str, lora: bool, checkpointing: bool, zero_stage: int) -> Any:
    """The job these settings would be: the Learner's settings and the memory plan read the same spec."""
    from opd_trainer.jobspec.job_spec import parse_job_spec

    hyper_parameters: dict[str, Any] = {
        "learning_rate": 1e-5,
        "lr_scheduler_type": "constant",
        "seed": 0,
        "distill_loss": args.estimator,
        "teacher_top_k": args.teacher_top_k,
        "ppo_mini_batch_size": args.rows,
        "batch_size": args.rows // args.n_rollouts,
        "n_rollouts": args.n_rollouts,
        "max_tokens": args.max_new_tokens,
        "max_length": args.prompt_tokens + args.max_new_tokens,
        "kl_loss_coef": 0.0,
        "gradient_checkpointing": checkpointing,
    }
    if lora:
        hyper_parameters["lora"] = {
            "r": LORA_R,
            "lora_alpha": LORA_ALPHA,
            "lora_dropout": 0.0,
            "target_modules": list(LORA_TARGETS),
        }
    return parse_job_spec(
        {
            "job_name": "gpu-learner-check",
            "model": model,
            "teacher_model": model,
            "training_datasets": ["unused.jsonl"],
            "hyper_parameters": hyper_parameters,
            "resources": {"zero_stage": zero_stage, "learner_gpus": 1},
        }
    )


def part_deepspeed(args: argparse.Namespace, ctx: dict[str, Any], budget: Budget) -> dict[str, Any]:
    try:
        import deepspeed  # noqa: F401
    except ImportError as error:
        return {"status": "skipped", "note": f"deepspeed is not importable ({error}); carry its wheel"}
    ray_state = stub_ray_if_missing()
    from opd_trainer.cluster.ports import free_port
    from opd_trainer.learner.deepspeed_learner import Learner
    from opd_trainer.learner.settings import LearnerSettings

    device, config = ctx["device"], ctx["config"]
    batch = learner_batch(args, config.vocab_size)
    folder = Path(tempfile.mkdtemp(prefix="gpu-learner-check-"))
    out: dict[str, Any] = {"ray": ray_state, "zero_stage": args.zero_stage, "variants": {}}
    try:
        model = build_model(config, ctx["dtype"], torch.device("cpu"), seed=0)
        model.save_pretrained(folder, max_shard_size="100GB")
        del model
        ctx["model_dir"] = folder
        for name, lora, checkpointing in VARIANTS:
            if budget.left() < MIN_PART_S * 2:
                out["variants"][name] = {
                    "status": "skipped",
                    "note": f"{budget.left():.0f}s of the budget left",
                }
                continue
            try:
                spec = job_spec(args, str(folder), lora, checkpointing, args.zero_stage)
                settings = LearnerSettings.from_spec(spec, total_updates=args.warmup + args.steps)
                memory = PeakMemory(device)
                memory.start()
                learner = Learner(settings, master=f"127.0.0.1:{free_port()}")
                learner.initialize()
                module = learner._engine.module
                applied = {
                    "lora": type(module).__name__.startswith("Peft"),
                    "gradient_checkpointing": bool(getattr(module, "is_gradient_checkpointing", False)),
                }
                metrics: list[dict[str, float]] = []
                step = functools.partial(_recorded, metrics, learner.train_step, [batch])
                seconds = timed_steps(step, device, args.warmup, args.steps)
                peak = memory.peak()
                parameters = sum(p.numel() for p in module.parameters())
                trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
                out["variants"][name] = {
                    "status": "ok",
                    "asked": {"lora": lora, "gradient_checkpointing": checkpointing},
                    "applied": applied,
                    "step_s": statistics.median(seconds),
                    "step_all_s": seconds,
                    "peak_bytes": peak,
                    "peak_method": memory.method,
                    "parameters": parameters,
                    "trainable_parameters": trainable,
                    "bytes_per_parameter": peak / parameters,
                    "losses": [m.get("loss", float("nan")) for m in metrics],
                }
                del learner, module, step
            except Exception as error:
                out["variants"][name] = {"status": "error", "error": _error(error)}
            finally:
                # The process group stays: DeepSpeed keeps its own references to it, and the next
                # variant's `init_distributed` reuses it.
                free_memory(device)
    finally:
        ctx["deepspeed_variants"] = out["variants"]
    return out


# -- 5. memory plan ----------------------------------------------------------------------------------


def part_plan(args: argparse.Namespace, ctx: dict[str, Any], budget: Budget) -> dict[str, Any]:
    try:
        from opd_trainer.jobspec import memory_plan as mp
    except ImportError as error:
        print("memory plan not available")
        return {"status": "not available", "note": f"memory plan not available ({error})"}
    device, config = ctx["device"], ctx["config"]
    on_gpu = device.type == "cuda"
    # The budget sizes no term of the learner's plan; it is only what `learner_plan` takes.
    host_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    plan_budget = mp.Budget(
        kind="cuda" if on_gpu else "cpu",
        host_total=host_total,
        host_available=host_total,
        device_bytes=torch.cuda.get_device_properties(device).total_memory if on_gpu else None,
    )
    # Terms the measured peak does not see: on CUDA the context (outside the allocator); on CPU the
    # process's runtime (before the baseline) and the weight export (no export here).
    unseen = {"CUDA context"} if on_gpu else {"runtime", "weight export"}
    where = "device" if on_gpu else None
    out: dict[str, Any] = {"target_rel_error": PLAN_TARGET, "excluded_terms": sorted(unseen), "rows": {}}
    sources = [
        ("torch", ctx.get("learner_variants") or {}),
        ("deepspeed", ctx.get("deepspeed_variants") or {}),
    ]
    for source, variants in sources:
        for name, lora, checkpointing in VARIANTS:
            measured = variants.get(name, {})
            if measured.get("status") != "ok":
                continue
            zero = args.zero_stage if source == "deepspeed" else 0
            # What ran: the Learner may not apply LoRA / checkpointing yet (`applied`).
            ran = measured.get("applied", {"lora": lora, "gradient_checkpointing": checkpointing})
            spec = job_spec(args, "unused", ran["lora"], ran["gradient_checkpointing"], zero)
            shape = mp.ModelShape(
                parameters=measured["parameters"] - (measured["trainable_parameters"] if ran["lora"] else 0),
                dtype="bfloat16",
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                num_layers=config.num_hidden_layers,
                num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim,
                vocab_size=config.vocab_size,
                exact=True,
            )
            role = mp.learner_plan(shape, spec, args.prompt_tokens + args.max_new_tokens, plan_budget)
            terms = {
                t.name: t.bytes
                for t in role.terms
                if t.name not in unseen and (where is None or t.where == where)
            }
            planned = sum(terms.values())
            row: dict[str, Any] = {
                "terms": terms,
                "plan_bytes": planned,
                "measured_bytes": measured["peak_bytes"],
            }
            row["rel_error"] = (planned - measured["peak_bytes"]) / measured["peak_bytes"]
            if source == "torch":
                # torch AdamW: no fp32 master, moments in the parameter dtype (DeepSpeed's are fp32).
                weight_bytes = ctx["dtype"].itemsize
                plain = dict(terms)
                plain.pop("fp32 master", None)
                if "optimizer (AdamW)" in plain:
                    plain["optimizer (AdamW)"] = plain["optimizer (AdamW)"] * weight_bytes // 4
                row["plan_plain_adamw_bytes"] = sum(plain.values())
                row["plain_adamw_rel_error"] = (sum(plain.values()) - measured["peak_bytes"]) / measured[
                    "peak_bytes"
                ]
                compared = row["plain_adamw_rel_error"]
            else:
                compared = row["rel_error"]
            row["within_target"] = abs(compared) <= PLAN_TARGET
            row["planned_as"] = ran
            out["rows"][f"{source}/{name}"] = row
    if not out["rows"]:
        out["note"] = "no measured peaks (parts learner / deepspeed did not run or failed)"
    return out


# -- driver ------------------------------------------------------------------------------------------


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}\n" + "".join(traceback.format_exception(error)[-4:])


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
    }
    for name in ("transformers", "peft", "deepspeed", "triton", "ray", "vllm"):
        try:
            info[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception:
            info[name] = None
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": properties.name,
            "gpu_memory_bytes": properties.total_memory,
            "cuda": torch.version.cuda,
        }
    return info


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every asked part, each guarded; the record (also written to `args.out`)."""
    started = time.monotonic()
    budget = Budget(args.budget_s)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch sees no CUDA GPU (use --device cpu for the smoke run)")
        torch.cuda.set_device(device)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    config = model_config(args)
    ctx: dict[str, Any] = {"device": device, "dtype": dtype, "config": config}
    record: dict[str, Any] = {
        "script": "benchmarks/gpu_learner_check.py",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": device_info(device),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {
            "size": args.size,
            "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "intermediate_size": config.intermediate_size,
            "vocab_size": config.vocab_size,
            "dtype": str(dtype).removeprefix("torch."),
        },
        "parts": {},
    }
    functions = {
        "learner": part_learner,
        "losses": part_losses,
        "ipc": part_ipc,
        "deepspeed": part_deepspeed,
        "plan": part_plan,
    }
    for name in PARTS:
        if name not in args.parts:
            continue
        if name != "plan" and budget.left() < MIN_PART_S:
            record["parts"][name] = {
                "status": "skipped",
                "note": f"{budget.left():.0f}s of {args.budget_s}s left",
            }
            continue
        part_started = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            result = functions[name](args, ctx, budget)
            status = result.pop("status", "ok") if isinstance(result, dict) else "ok"
            record["parts"][name] = {"status": status, **result}
        except Exception as error:
            record["parts"][name] = {"status": "error", "error": _error(error)}
            free_memory(device)
        record["parts"][name]["seconds"] = time.monotonic() - part_started
        print(f"   {record['parts'][name]['status']} in {record['parts'][name]['seconds']:.1f}s", flush=True)
    record["elapsed_s"] = time.monotonic() - started
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record


def _first_line(row: dict[str, Any]) -> str:
    text = str(row.get("error") or row.get("note") or "")
    return text.splitlines()[0] if text else ""


def print_table(record: dict[str, Any]) -> None:
    parts = record["parts"]
    environment = record["environment"]
    print(f"\n{environment.get('gpu', environment['device'])}, model {record['model']}")
    for source in ("learner", "deepspeed"):
        part = parts.get(source, {})
        if not part.get("variants"):
            continue
        header = f"{'step ms':>9} {'peak MiB':>10} {'params':>12} {'trainable':>12} {'B/param':>8}"
        print(f"\n{source + ':':<12} {'variant':<10} {header}")
        for name, row in part["variants"].items():
            if row.get("status") != "ok":
                print(f"  {name:<20} {row.get('status')}: {_first_line(row)}")
                continue
            applied = f"  applied {row['applied']}" if "applied" in row else ""
            print(
                f"  {name:<20} {row['step_s'] * 1000:>9.1f} {row['peak_bytes'] / MIB:>10.1f} "
                f"{row['parameters']:>12,} {row['trainable_parameters']:>12,} "
                f"{row['bytes_per_parameter']:>8.2f}{applied}"
            )
    losses = parts.get("losses", {})
    if losses.get("estimators"):
        print(f"\nlosses vs fp64, loss_rel/grad_rel (passed: {losses.get('passed')}):")
        modes = (*LOSS_THRESHOLDS, "bf16_total (bounds)")
        print(f"  {'estimator':<18} {' | '.join(f'{mode:<17}' for mode in modes)}")
        for name, row in losses["estimators"].items():
            if row.get("status") != "ok":
                print(f"  {name:<18} {row.get('status')}: {_first_line(row)}")
                continue
            modes = (*LOSS_THRESHOLDS, "bf16_total")
            cells = " | ".join(f"{row[m]['loss_rel']:.1e}/{row[m]['grad_rel']:.1e}  " for m in modes)
            print(f"  {name:<18} {cells} {'ok' if row['passed'] else 'FAIL'}")
    ipc = parts.get("ipc", {})
    if ipc.get("status") == "ok":
        print(
            f"\nipc: {ipc['bytes'] / MIB:.1f} MiB in {ipc['buckets']} bucket(s), {ipc['gb_per_s']:.2f} GB/s, "
            f"checksums equal {ipc['checksums_equal']}, logits diff {ipc['logits_max_abs_diff']:.1e}, "
            f"passed {ipc['passed']}\n     {ipc['transport']}; helpers: {ipc['helpers']}"
        )
    plan = parts.get("plan", {})
    if plan.get("rows"):
        print(f"\nmemory plan vs measured (target |rel| <= {PLAN_TARGET}):")
        for name, row in plan["rows"].items():
            plain = row.get("plan_plain_adamw_bytes")
            extra = (
                f", as plain AdamW {plain / MIB:.1f} ({row['plain_adamw_rel_error']:+.2f})" if plain else ""
            )
            print(
                f"  {name:<20} measured {row['measured_bytes'] / MIB:>9.1f} MiB, "
                f"plan {row['plan_bytes'] / MIB:>9.1f} ({row['rel_error']:+.2f}){extra}; "
                f"within target: {row['within_target']}"
            )
    elif plan:
        print(f"\nmemory plan: {plan.get('status')} {_first_line(plan)}")
    for name, part in parts.items():
        if part.get("status") not in ("ok",):
            print(f"{name}: {part['status']}: {_first_line(part)}")
    print(f"\nelapsed {record['elapsed_s']:.0f}s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (the smoke run)")
    parser.add_argument("--dtype", default=None, help="model dtype (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--size", choices=("qwen2.5-0.5b", "small"), default="qwen2.5-0.5b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 24; 2 with small)")
    parser.add_argument(
        "--vocab-size", type=int, default=None, help=f"default {QWEN25_VOCAB}; 1024 with small"
    )
    parser.add_argument("--rows", type=int, default=8, help="completions in the mini-batch")
    parser.add_argument("--n-rollouts", type=int, default=4, help="completions per prompt")
    parser.add_argument(
        "--prompt-tokens", type=int, default=512, help="longest prompt (half is a shared preamble)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--teacher-top-k", type=int, default=8)
    parser.add_argument("--estimator", default="topk_forward")
    parser.add_argument(
        "--forward",
        choices=("auto", "shared_prefix", "padded"),
        default="auto",
        help="auto: shared_prefix (the Learner's), padded under gradient checkpointing (needs no KV cache)",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--loss-rows", type=int, default=4)
    parser.add_argument("--loss-tokens", type=int, default=64, help="scored positions of the loss check")
    parser.add_argument("--bucket-mb", type=int, default=512, help="IPC bucket size (weight_sync's default)")
    parser.add_argument("--ipc-rounds", type=int, default=3)
    parser.add_argument("--zero-stage", type=int, default=2, help="the real Learner's (job default)")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}"
    )
    parser.add_argument("--budget-s", type=float, default=420.0, help="all parts together")
    parser.add_argument(
        "--block-imports", default="", help="e.g. ray,vllm,deepspeed: act as if not installed"
    )
    parser.add_argument(
        "--out",
        type=lambda value: Path(value) if value else None,
        default=Path("benchmarks/results/gpu_learner_check.json"),
        help="the JSON record ('' writes none)",
    )
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if args.rows % args.n_rollouts:
        parser.error(f"--rows ({args.rows}) must be a multiple of --n-rollouts ({args.n_rollouts})")
    return args


def blocked_imports(args: argparse.Namespace) -> list[str]:
    return [name.strip() for name in args.block_imports.split(",") if name.strip()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    block_imports(blocked_imports(args))
    record = run(args)
    print_table(record)
    if args.out:
        print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
