"""DeepSpeed learner actor: minimises the OPD loss on the student's own samples and publishes weights.

`Learner` is a plain class (one data-parallel rank); `LearnerActor` is it as a Ray actor and
`LearnerGroup` drives `world_size` ranks in lock-step. Every call that holds a collective (a ZeRO-3
parameter gather in a forward, the weight export, a checkpoint) runs on every rank; rank 0's answer is
the one returned. The pure parts live apart, tested without Ray: the typed batch and the forward
(`learner/batch.py`), the estimators (`learner/estimators.py`), the loss (`learner/loss.py`).

Hardware: fp32 + gloo with `DS_ACCELERATOR=cpu` on a CPU box; bf16 + NCCL, one GPU per rank, on CUDA.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd_trainer.cluster.placement import gang, in_gang, placed
from opd_trainer.cluster.ports import free_port
from opd_trainer.cluster.process_usage import actor_usage
from opd_trainer.errors import WeightSyncError
from opd_trainer.learner import adapters
from opd_trainer.learner.batch import (
    LearnerBatch,
    logprobs_of_targets,
    pad_segments,
    prefix_plan,
    row_advantages,
    scored_logits,
)
from opd_trainer.learner.estimators import distillation_loss
from opd_trainer.learner.loss import group_reward_advantages, kl_to_reference
from opd_trainer.learner.preference_loss import beacon_sft_loss, preference_loss
from opd_trainer.learner.settings import LearnerSettings, lr_schedule
from opd_trainer.learner.shared_prefix import PrefixPlan, causal_keys, model_calls
from opd_trainer.records import LLMCall
from opd_trainer.storage.shared import check_probe
from opd_trainer.weight_sync import transports
from opd_trainer.weight_sync.transports import WeightHandoff

logger = logging.getLogger(__name__)


class Learner:
    """One DeepSpeed data-parallel rank holding the student being trained."""

    def __init__(
        self, settings: LearnerSettings, rank: int = 0, world_size: int = 1, master: str = ""
    ) -> None:
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self._master = master or f"127.0.0.1:{free_port()}"
        self._engine: Any = None
        self._reference: Any = None
        self._reference_adapter: dict[str, torch.Tensor] | None = None
        """Under LoRA with a 'rolling' reference: the adapter's weights at the last refresh."""
        self._steps_since_refresh = 0
        self._device: torch.device | None = None
        self._zero_stage = settings.zero_stage

    # -- set-up ---------------------------------------------------------------------------------

    def rendezvous_address(self) -> str:
        """`host:port` on this rank's node for the process group's rendezvous (asked of rank 0)."""
        # The store listens on every interface: the port must be free on all of them, not only on
        # the node's address (a port free there may be taken on 127.0.0.1: EADDRINUSE).
        return f"{ray.util.get_node_ip_address()}:{free_port('0.0.0.0')}"

    def check_storage(self, run_dir: str, token: str) -> None:
        """Fails, naming this rank's host, unless it sees the run dir checkpoints are written to."""
        check_probe(Path(run_dir), token, f"learner rank {self.rank}")

    def initialize(self, master: str | None = None) -> None:
        """Builds model, optimizer, schedule and the DeepSpeed engine (idempotent). `master`: the
        process group's rendezvous (rank 0's `rendezvous_address`), if not given at construction."""
        if master:
            self._master = master
        if self._engine is not None:
            return
        on_gpu = torch.cuda.is_available()
        self._export_process_group_env(on_gpu)
        # Imported here, not at the top: deepspeed picks its accelerator at import time (set just above).
        import deepspeed

        if not on_gpu:
            self._use_every_allowed_core()
        torch.manual_seed(self.settings.seed)
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
        self._device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        dtype = torch.bfloat16 if on_gpu else torch.float32
        self._zero_stage = self._effective_zero_stage(on_gpu)
        model, optimizer, scheduler = self._model_optimizer_scheduler(dtype)
        self._engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self._deepspeed_config(on_gpu)
        )
        if self.settings.frozen_student and self.settings.lora is None:
            # Under LoRA the initial student is the base model with the adapter switched off: no copy.
            self._reference = self._frozen_reference(dtype)
        if self._rolling and self.settings.lora is not None and self._zero_stage == 3:
            raise ValueError(
                "hyper_parameters.turn_preference_reference 'rolling' keeps a copy of the LoRA adapter, "
                "which ZeRO-3 partitions: use 'initial', or resources.zero_stage 0-2"
            )
        logger.info("learner rank %d/%d ready (ZeRO-%d)", self.rank, self.world_size, self._zero_stage)

    def _effective_zero_stage(self, on_gpu: bool) -> int:
        """The job's ZeRO stage, except 0 for ZeRO-1/2 on a single CPU rank without optimizer offload.

        ZeRO-1/2 partition optimizer state and gradients across ranks; with one rank there is nothing to
        partition, and on CPU (fp32) they only add DeepSpeed's fp32 flat copy of the weights and its
        gradient buffers (benchmarks/learner_memory.py, 151 M parameters: 17.4 vs 13.2 bytes a parameter
        after a step). On GPU (bf16) ZeRO keeps fp32 master weights either way, so the stage is kept.
        """
        stage = self.settings.zero_stage
        if self.world_size == 1 and not on_gpu and not self.settings.optimizer_offload and stage in (1, 2):
            return 0
        return stage

    def _export_process_group_env(self, on_gpu: bool) -> None:
        """Sets the environment deepspeed reads: its accelerator (CPU only), rendezvous, rank, world size."""
        if not on_gpu:
            # Must be set before deepspeed is imported: it picks its accelerator at import time.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        host, port = self._master.rsplit(":", 1)
        os.environ.update(
            MASTER_ADDR=host,
            MASTER_PORT=port,
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
        )

    @staticmethod
    def _use_every_allowed_core() -> None:
        """Gives torch a thread per core this process may run on (CPU learner only)."""
        # Ray sets OMP_NUM_THREADS to the actor's 1 CPU slot, which left torch one thread. On CPU the
        # learner runs while the engines wait for its weights (strictly on-policy), so it takes
        # every core this process may use (learner 3.13 s -> 1.88 s a step, benchmarks/step_breakdown.py).
        affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere all of the machine's
        torch.set_num_threads(len(affinity(0)) if affinity else os.cpu_count() or 1)

    def _model_optimizer_scheduler(self, dtype: torch.dtype) -> tuple[Any, torch.optim.Optimizer, Any]:
        """The student loaded from `model_path` (with a fresh LoRA adapter when the job trains one), the
        optimizer of its trained parameters (AdamW; DeepSpeed's CPU Adam with `optimizer_offload`, which
        DeepSpeed requires there) and the learning-rate schedule."""
        settings = self.settings
        model = AutoModelForCausalLM.from_pretrained(
            settings.model_path, dtype=dtype, trust_remote_code=False
        )
        model.config.use_cache = False
        if settings.gradient_checkpointing:
            # Non-reentrant: gradients reach the layers' inputs without `enable_input_require_grads`,
            # also where the embeddings are frozen (LoRA).
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if settings.lora is not None:
            model = adapters.with_adapter(model, settings.lora, settings.model_path)
        # transformers checkpoints layers and PEFT drops adapter inputs only in training mode; otherwise the
        # learner stays in eval mode as loaded, so that no dropout makes its logprobs noisier than the
        # sampler's (Qwen2 / Llama configs have none).
        lora_dropout = settings.lora is not None and settings.lora.lora_dropout > 0
        model.train(settings.gradient_checkpointing or lora_dropout)
        trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
        optimizer: torch.optim.Optimizer
        if settings.optimizer_offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam  # builds its C++ op at first use (~1 min)

            optimizer = DeepSpeedCPUAdam(
                trained, lr=settings.learning_rate, weight_decay=settings.weight_decay, adamw_mode=True
            )
        else:
            optimizer = torch.optim.AdamW(
                trained, lr=settings.learning_rate, weight_decay=settings.weight_decay
            )
        total, schedule = self.settings.total_updates, self.settings.lr_scheduler_type
        warmup = round(self.settings.warmup_ratio * total)
        return model, optimizer, lr_schedule(optimizer, schedule, total, warmup)

    def _deepspeed_config(self, on_gpu: bool) -> dict[str, Any]:
        """DeepSpeed's config: one micro-batch per engine step, clipping, ZeRO stage (optimizer state in
        host memory with `optimizer_offload`), bf16 on GPU only."""
        zero: dict[str, Any] = {"stage": self._zero_stage}
        if self.settings.optimizer_offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
        return {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.settings.max_grad_norm,
            "zero_optimization": zero,
            "bf16": {"enabled": on_gpu},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }

    def _frozen_reference(self, dtype: torch.dtype) -> Any:
        """A frozen copy of the initial student for KL(learner ‖ initial); only paid for when used."""
        reference = AutoModelForCausalLM.from_pretrained(
            self.settings.model_path, dtype=dtype, trust_remote_code=False
        )
        reference.to(self._device).eval().requires_grad_(False)
        return reference

    @property
    def _rolling(self) -> bool:
        return self.settings.turn_preference_coef > 0 and self.settings.turn_preference_reference == "rolling"

    def _refresh_reference(self) -> None:
        """A 'rolling' reference becomes the learner's weights now (TurnSight's per-round reference):
        the frozen copy loads them (gathered under ZeRO-3), or under LoRA the adapter's are kept."""
        if self.settings.lora is not None:
            self._reference_adapter = {
                name: parameter.detach().clone()
                for name, parameter in self._engine.module.named_parameters()
                if parameter.requires_grad
            }
        else:
            # strict=False: a tied tensor is named once (`named_weights`); nothing else may be missing.
            result = self._reference.load_state_dict(dict(self.named_weights()), strict=False)
            tied = {name for name, _ in self._reference.named_parameters(remove_duplicate=False)} - {
                name for name, _ in self._reference.named_parameters()
            }
            if result.unexpected_keys or set(result.missing_keys) - tied:
                raise RuntimeError(
                    f"the rolling reference could not take the learner's weights: missing "
                    f"{sorted(set(result.missing_keys) - tied)}, unexpected {result.unexpected_keys}"
                )
        self._steps_since_refresh = 0

    # -- forward ------------------------------------------------------------------------------

    def _forward_plan(self, batch: LearnerBatch) -> PrefixPlan | None:
        """This rank's shared-prefix plan of `batch`, or None (the plain forward) where the ranks'
        plans would call the model a different number of times.

        Under ZeRO-3 every module call gathers its partitioned parameters, a collective: each rank
        must call the model as often as the others. A plan's call count depends on its rank's shard
        (one prompt group or several, a common preamble or none), so under ZeRO-3 with several ranks
        they compare counts first (one small all-reduce) and all take the plain forward, one call
        each, unless every rank's count is the same.
        """
        if self.settings.gradient_checkpointing:
            # transformers' checkpointed layers drop the KV cache that the shared-prefix forward hands
            # from one level to the next (`GradientCheckpointingLayer`): the plain forward, on every rank.
            return None
        plan = prefix_plan(batch)
        if self._zero_stage != 3 or self.world_size == 1:
            return plan
        calls = model_calls(plan)
        extremes = torch.tensor([calls, -calls], device=self._device)
        torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX)
        return plan if int(extremes[0]) == -int(extremes[1]) else None

    def compute_logprobs(self, segments: list[LLMCall]) -> list[list[float]]:
        """The learner's logprob of each completion token (pre-flight drift probe, tests). Under
        ZeRO-3 the forward is collective: every rank calls this with the same segments."""
        self.initialize()
        batch = pad_segments(segments, 0, self._device)
        # Eval mode: no dropout, and no checkpointed layer dropping the shared-prefix forward's cache.
        with torch.no_grad(), _eval_mode(self._engine.module):
            logits_B_S_V = scored_logits(self._engine.module, batch, prefix_plan(batch), self._device)
            logprobs = logprobs_of_targets(logits_B_S_V, batch, self.settings.temperature).cpu()
        first = batch.first_scored_position  # every row's first completion token is predicted there
        return [
            logprobs[row, first : first + len(segment.completion_token_ids)].tolist()
            for row, segment in enumerate(segments)
        ]

    # -- training -------------------------------------------------------------------------------

    def train_step(
        self, minibatches: list[list[LLMCall]], minibatch_tokens: list[float] | None = None
    ) -> dict[str, float]:
        """One OPD step: one optimizer update per mini-batch (this rank's share of each).

        Every rank must get the same number of mini-batches: each update is a collective.
        `minibatch_tokens[i]`: trained tokens of mini-batch i over all ranks (None: one rank), which
        normalises each rank's loss so that the averaged gradient is the whole mini-batch's.
        """
        self.initialize()
        if not minibatches or not all(minibatches):
            raise ValueError("train_step needs non-empty mini-batches")
        if self._rolling and self._steps_since_refresh % self.settings.turn_preference_reference_steps == 0:
            self._refresh_reference()
        self._steps_since_refresh += 1
        totals: dict[str, float] = {}
        counts: dict[str, int] = {}
        ratio_max = 0.0
        forwarded = attended = 0
        grad_norms: list[float] = []
        for index, minibatch in enumerate(minibatches):
            num_tokens = None if minibatch_tokens is None else minibatch_tokens[index] / self.world_size
            batch = pad_segments(minibatch, self.settings.distillation.teacher_top_k, self._device)
            plan = self._forward_plan(batch)
            if plan is None:
                forwarded += sum(batch.lengths)
                attended += sum(causal_keys(0, length) for length in batch.lengths)
            else:
                forwarded += plan.forwarded_tokens
                attended += plan.attended_keys
            stats = self._update(batch, plan, num_tokens)
            grad_norm = stats.pop("grad_norm", None)
            if grad_norm is None:
                grad_norm = self._engine.get_global_grad_norm()
            if grad_norm is not None:
                grad_norms.append(float(grad_norm))
            ratio_max = max(ratio_max, stats.pop("ratio_max"))
            # Per-token statistics of this rank's share, weighted by that share of the mini-batch's
            # tokens (1 with one rank), so that the ranks' plain mean is the mini-batch's token mean.
            share = 1.0 if num_tokens is None else float(batch.mask_B_T.sum()) / num_tokens
            for name, value in stats.items():
                weight = share if name in TOKEN_WEIGHTED_METRICS else 1.0
                if name in MAXED_METRICS:
                    totals[name] = max(totals.get(name, value), value)
                else:
                    totals[name] = totals.get(name, 0.0) + weight * value
                counts[name] = counts.get(name, 0) + 1
        # Each metric's mean over the mini-batches that report it (the preference term's only where a
        # mini-batch holds a whole pair); counts summed, maxima maxed.
        metrics = {
            name: value if name in SUMMED_METRICS | MAXED_METRICS else value / counts[name]
            for name, value in totals.items()
        }
        metrics["ratio_max"] = ratio_max
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
        metrics["lr"] = float(self._engine.get_lr()[0])
        metrics["optimizer_updates"] = float(len(minibatches))
        # Tokens forwarded and back-propagated (shared prefixes once): the learner's work, FLOPs ∝ this.
        metrics["learner_tokens"] = float(forwarded)
        metrics["learner_attended_keys"] = float(attended)
        return metrics

    def _update(
        self, batch: LearnerBatch, plan: PrefixPlan | None, num_tokens: float | None
    ) -> dict[str, float]:
        """One optimizer update on `batch`: forward, the estimator's loss (+ the turn-level preference
        term, + the kept beacon rewrites' NLL, + the KL to the initial student), backward, step.
        Returns `loss`, `kl_to_initial`, the `preference/*` and `beacons/sft_*` stats when used, the
        two gradient norms (`_split_grad_norms`) and the estimator's stats."""
        settings = self.settings
        reward_adv_B = group_reward_advantages(
            batch.rewards_B, batch.group_ids_B, batch.rollout_ids_B, settings.normalize_reward_by_std
        )
        # The frozen student first: a LoRA 'rolling' reference swaps the adapter's weights in and out,
        # which must not happen under a forward whose graph is waiting for its backward.
        has_pairs = settings.turn_preference_coef > 0 and batch.preference_sides_B_P.shape[1] > 0
        frozen_for_pairs = (
            settings.turn_preference_coef > 0
            and settings.turn_preference_reference != "teacher"
            and self._on_any_rank(has_pairs)
        )
        kl_reference_B_T, preference_reference_B_T = self._reference_logprobs(
            batch, plan, kl=settings.kl_loss_coef > 0, preference=frozen_for_pairs
        )
        logits_B_S_V = scored_logits(self._engine, batch, plan, self._device)
        learner_B_T = logprobs_of_targets(logits_B_S_V, batch, settings.temperature)
        inputs = batch.distillation_inputs(
            logits_B_S_V,
            learner_B_T,
            row_advantages(settings, reward_adv_B, batch.hindsight_B),
            num_tokens,
        )
        total, stats = distillation_loss(settings.distillation, inputs)
        logged = {
            name: float(stats[name]) for name in (*TOKEN_WEIGHTED_METRICS, "ratio_max") if name in stats
        }
        # The preference and SFT terms read logprobs at temperature 1, as the teacher's scores are
        # (vLLM's prompt logprobs) and as the rewrites were written.
        plain_B_T = (
            learner_B_T if settings.temperature == 1.0 else logprobs_of_targets(logits_B_S_V, batch, 1.0)
        )
        preference: torch.Tensor | None = None
        if has_pairs:
            preference, preference_stats = self._preference_term(
                batch, plain_B_T, preference_reference_B_T if frozen_for_pairs else batch.teacher_B_T
            )
            weighted_preference = settings.turn_preference_coef * preference
            total = total + weighted_preference
            logged.update(preference_stats)
        if settings.beacon_sft_coef > 0:
            sft, sft_stats = beacon_sft_loss(plain_B_T, batch.completion_mask_B_T, batch.beacon_rows_B)
            total = total + settings.beacon_sft_coef * sft
            logged.update(sft_stats)
        if kl_reference_B_T is not None:
            kl_ref = kl_to_reference(learner_B_T, kl_reference_B_T, batch.mask_B_T, num_tokens)
            total = total + settings.kl_loss_coef * kl_ref
            logged["kl_to_initial"] = float(kl_ref.detach())
        preference_grads = self._preference_gradients(preference)
        self._engine.backward(total if preference_grads is None else total - weighted_preference)
        if self._zero_stage == 0:
            # Without ZeRO, DeepSpeed clips with torch's clip_grad_norm_ and keeps no norm
            # (`get_global_grad_norm` is None): the norm before clipping, as ZeRO reports it.
            gradients = [p.grad for p in self._engine.module.parameters() if p.grad is not None]
            logged["grad_norm"] = float(torch.nn.utils.get_total_norm(gradients)) if gradients else 0.0
        if preference_grads is not None:
            logged.update(self._split_grad_norms(preference_grads))
        self._engine.step()
        logged["loss"] = float(total.detach())
        return logged

    def _preference_term(
        self, batch: LearnerBatch, plain_B_T: torch.Tensor, reference_B_T: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The DPO term over the batch's pairs against the job's reference (`reference_B_T`: the frozen
        or rolling student's logprobs, or the teacher's), reduced per prompt or per pair, sides swapped
        for the negative control."""
        settings = self.settings
        sides_B_P = (
            -batch.preference_sides_B_P if settings.turn_preference_swap else batch.preference_sides_B_P
        )
        prompts = len(set(batch.group_ids_B.tolist()))
        return preference_loss(
            plain_B_T,
            reference_B_T,
            batch.completion_mask_B_T,
            sides_B_P,
            settings.turn_preference_beta,
            per=prompts if settings.turn_preference_reduction == "prompts" else None,
        )

    def _preference_gradients(self, preference: torch.Tensor | None) -> list[torch.Tensor] | None:
        """On one rank without ZeRO, back-propagates the weighted preference term alone first (the
        graph kept for the rest of the update) and returns a copy of the gradients it left, for
        `_split_grad_norms`; the caller then back-propagates the other terms into the same gradients.
        Under ZeRO (whose gradients live in partitioned buffers) or with several ranks, None: the
        update is one backward and the two norms are not reported."""
        if preference is None or self._zero_stage != 0 or self.world_size > 1 or not preference.requires_grad:
            # Several ranks: each engine.backward all-reduces the gradients, and a rank whose shard holds
            # no pair would make one all-reduce fewer than the others.
            return None
        self._engine.backward(self.settings.turn_preference_coef * preference, retain_graph=True)
        return [
            p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for p in self._engine.module.parameters()
            if p.requires_grad
        ]

    def _split_grad_norms(self, preference_grads: list[torch.Tensor]) -> dict[str, float]:
        """`grad_norm/preference`: the norm of the preference term's gradient per unit of
        `turn_preference_coef`; `grad_norm/distillation`: the norm of everything else in the update
        (the distillation, reward, SFT and KL terms). Their ratio is how to pick the coefficient:
        coef ≈ wanted share × distillation / preference."""
        coef = self.settings.turn_preference_coef
        rest_sq = preference_sq = 0.0
        trained = [p for p in self._engine.module.parameters() if p.requires_grad]
        for parameter, weighted in zip(trained, preference_grads, strict=True):
            preference_sq += float(weighted.pow(2).sum())
            if parameter.grad is not None:
                rest_sq += float((parameter.grad - weighted).pow(2).sum())
        return {
            "grad_norm/distillation": rest_sq**0.5,
            "grad_norm/preference": preference_sq**0.5 / coef,
        }

    def _on_any_rank(self, flag: bool) -> bool:
        """`flag` on this rank or any other. Under ZeRO-3 with several ranks every module call is a
        collective (it gathers the partitioned parameters), so whether the frozen student's forward
        runs must be decided together; elsewhere this rank's own `flag`."""
        if self._zero_stage != 3 or self.world_size == 1:
            return flag
        found = torch.tensor([float(flag)], device=self._device)
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        return bool(found.item())

    def _reference_logprobs(
        self, batch: LearnerBatch, plan: PrefixPlan | None, kl: bool, preference: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """[B, T] logprobs of the frozen student on `batch`: at the sampling temperature for the KL to
        the initial student (`kl`), at temperature 1 for the preference term's 'initial' or 'rolling'
        reference (`preference`); None where not asked. One forward: the frozen copy, or under LoRA
        the base model with the adapter switched off (a 'rolling' reference: with the adapter's
        weights of the last refresh swapped in). Its full-vocabulary logits are dropped before the
        learner's own forward."""
        if not (kl or preference):
            return None, None
        with torch.no_grad():
            logits_B_S_V = self._frozen_logits(batch, plan)
            temperature = self.settings.temperature
            kl_B_T = logprobs_of_targets(logits_B_S_V, batch, temperature) if kl else None
            if preference and kl and temperature == 1.0:
                return kl_B_T, kl_B_T
            preference_B_T = logprobs_of_targets(logits_B_S_V, batch, 1.0) if preference else None
            return kl_B_T, preference_B_T

    def _frozen_logits(self, batch: LearnerBatch, plan: PrefixPlan | None) -> torch.Tensor:
        if self._reference is not None:
            return scored_logits(self._reference, batch, plan, self._device)
        module = self._engine.module
        if self._reference_adapter is None:
            with module.disable_adapter(), _eval_mode(module):
                return scored_logits(module, batch, plan, self._device)
        with self._adapter_swapped(self._reference_adapter), _eval_mode(module):
            return scored_logits(module, batch, plan, self._device)

    @contextlib.contextmanager
    def _adapter_swapped(self, weights: dict[str, torch.Tensor]) -> Any:
        """The LoRA adapter holding `weights` for the block, its own after."""
        parameters = dict(self._engine.module.named_parameters())
        own = {name: parameters[name].detach().clone() for name in weights}
        with torch.no_grad():
            for name, tensor in weights.items():
                parameters[name].copy_(tensor)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, tensor in own.items():
                    parameters[name].copy_(tensor)

    # -- weights and checkpoints ----------------------------------------------------------------

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Full (gathered) weights under Hugging Face names, as the engines load them.

        Tied tensors (e.g. `lm_head.weight` = `model.embed_tokens.weight`) appear once, under their
        first name, as in a tied checkpoint: the engine re-ties them on load. Without ZeRO-3 they are
        the module's own tensors (no copy: the transport streams them); under ZeRO-3 each parameter is
        gathered, copied out and released in turn, so the whole model is never held twice.
        Full training only: a LoRA job hands over its adapter (`adapter_files`).
        """
        if self.settings.lora is not None:
            raise WeightSyncError(
                "named_weights / export_weights hand over the whole model, and this job trains a LoRA "
                "adapter (hyper_parameters.lora): hand over adapter_files() instead"
            )
        module = self._engine.module

        def untied(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
            seen: set[int] = set()
            weights = []
            for name, tensor in state.items():
                if tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    weights.append((name, tensor.detach()))
            return weights

        if self._zero_stage == 3:
            return self._gathered_one_by_one(module)
        return untied(module.state_dict())

    def _gathered_one_by_one(self, module: Any) -> list[tuple[str, torch.Tensor]]:
        """ZeRO-3: the state dict's tensors, each parameter gathered alone (a collective on every rank)
        and copied to the host; a tied parameter (one object under several names) once."""
        import deepspeed  # imported on use: its accelerator is chosen by `initialize` (see there)

        parameters = {id(parameter) for parameter in module.parameters()}
        seen: set[int] = set()
        weights = []
        for name, tensor in module.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            gathered = (
                deepspeed.zero.GatheredParameters([tensor], modifier_rank=None)
                if id(tensor) in parameters
                else contextlib.nullcontext()
            )
            with gathered:
                weights.append((name, tensor.detach().to("cpu", copy=True)))
        return weights

    def adapter_files(self) -> dict[str, bytes]:
        """The current LoRA adapter as a PEFT folder's files (`adapter_config.json`,
        `adapter_model.safetensors` under PEFT's key names, `base_model_name_or_path` the student's
        `model_path`): what vLLM's `LoRARequest` and `PeftModel.from_pretrained` load
        (`adapters.write_adapter_files` writes the folder). Every rank takes part (ZeRO-3 gathers the
        adapter collectively); rank 0's files are returned, {} on the other ranks."""
        self.initialize()
        if self.settings.lora is None:
            raise WeightSyncError("adapter_files needs a LoRA job (hyper_parameters.lora); export_weights")
        module = self._engine.module
        with self._gathered([parameter for parameter in module.parameters() if parameter.requires_grad]):
            return adapters.adapter_files(module) if self.rank == 0 else {}

    def _gathered(self, parameters: list[torch.nn.Parameter]) -> contextlib.AbstractContextManager[Any]:
        """Under ZeRO-3 `parameters` gathered whole for the block (collective); else nothing to do."""
        if self._zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed  # imported on use: its accelerator is chosen by `initialize` (see there)

        return deepspeed.zero.GatheredParameters(parameters, modifier_rank=None)

    def export_weights(self, kinds: list[str]) -> dict[str, WeightHandoff]:
        """The current weights as one handoff per transport asked for (`weight_sync`: "shm" a
        tmpfs file on this node, "ray" Ray's object store), for the engine group to hand to its
        replicas. Every rank takes part (ZeRO-3 gathers the parameters collectively); rank 0's
        handoffs are the ones returned. Call `release_weights` once every engine has loaded them."""
        self.initialize()
        weights = self.named_weights()
        if self.rank != 0:
            return {}
        return transports.export_weights(weights, kinds)

    def release_weights(self, handoffs: list[WeightHandoff]) -> None:
        """Frees what `export_weights` made, each handoff by its own transport."""
        transports.release_weights(handoffs)

    def usage(self) -> dict[str, float]:
        """This rank's CPU-seconds so far and GPUs held (`process_usage.actor_usage`), for metering."""
        return actor_usage()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def save_checkpoint(self, directory: str) -> None:
        """DeepSpeed optimizer/scheduler state (every rank its shard) + the student in `student/` with
        its tokenizer, gathered on every rank (a collective under ZeRO-3) and written by rank 0: the HF
        `save_pretrained` model, or for a LoRA job the PEFT adapter folder (`adapters.merged_model`
        makes a whole model of it on request). A LoRA job's DeepSpeed state leaves out the frozen base."""
        self.initialize()
        path, lora = Path(directory), self.settings.lora is not None
        self._engine.save_checkpoint(str(path / "deepspeed"), tag="state", exclude_frozen_parameters=lora)
        student = path / "student"
        if lora:
            files = self.adapter_files()
            if self.rank == 0:
                adapters.write_adapter_files(files, student)
        else:
            weights = self.named_weights()
            if self.rank == 0:
                self._engine.module.save_pretrained(str(student), state_dict=dict(weights))
        if self.rank == 0:
            tokenizer = AutoTokenizer.from_pretrained(self.settings.model_path, trust_remote_code=False)
            tokenizer.save_pretrained(str(student))

    def load_checkpoint(self, directory: str) -> None:
        self.initialize()
        # A LoRA checkpoint holds the adapter alone; the frozen base is the one loaded from model_path.
        self._engine.load_checkpoint(
            str(Path(directory) / "deepspeed"), tag="state", load_module_strict=self.settings.lora is None
        )


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module) -> Any:
    """`module` in eval mode for the block, back in its mode after."""
    training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(training)


# The estimator's per-token statistics `Learner.train_step` reports, each weighted by the rank's share
# of the mini-batch's trained tokens.
TOKEN_WEIGHTED_METRICS = (
    "ratio_mean",
    "ratio_truncated_frac",
    "signal_std",
    "teacher_topk_mass",
    "student_topk_mass",
)

# How `Learner.train_step`'s metrics combine across data-parallel ranks. Each rank normalises its
# loss terms by the mini-batch's tokens over the ranks and weights its per-token statistics by its
# share of those tokens, so the plain mean over ranks is the whole mini-batch's value (`signal_std`,
# a spread, is combined the same way: an approximation); counts add up.
SUMMED_METRICS = frozenset({"learner_tokens", "learner_attended_keys", "beacons/sft_tokens"})
MAXED_METRICS = frozenset({"ratio_max", "preference/margin_abs_max"})
SHARED_METRICS = frozenset({"grad_norm", "lr", "optimizer_updates"})  # equal on every rank


def trained_tokens(segments: list[LLMCall]) -> float:
    """The tokens the distillation loss trains on (a beacon's rewrite is not distilled)."""
    return float(sum(len(s.completion_token_ids) for s in segments if s.distilled))


def reduce_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from every rank's: summed, maxed, shared, else the mean over ranks; a metric
    only some ranks report (the preference term's, on a rank whose shard held no whole pair) is
    reduced over those."""
    reduced: dict[str, float] = {}
    names = list(dict.fromkeys(name for metrics in per_rank for name in metrics))
    for name in names:
        values = [metrics[name] for metrics in per_rank if name in metrics]
        if name in SUMMED_METRICS:
            reduced[name] = sum(values)
        elif name in MAXED_METRICS:
            reduced[name] = max(values)
        elif name in SHARED_METRICS:
            reduced[name] = values[0]
        else:
            reduced[name] = sum(values) / len(values)
    return reduced


LearnerActor = ray.remote(Learner)
"""`Learner` as a Ray actor (one per data-parallel rank)."""


class LearnerGroup:
    """`world_size` learner ranks driven in lock-step; segments are split evenly across ranks."""

    def __init__(
        self,
        settings: LearnerSettings,
        world_size: int,
        num_gpus_per_rank: float,
        placement_timeout_s: float = 600.0,
        ray_resources: dict[str, float] | None = None,
    ) -> None:
        self.demand = {"CPU": 1.0, "GPU": num_gpus_per_rank, **(ray_resources or {})}
        self.placement_timeout_s = placement_timeout_s
        self.group = gang(self.demand, world_size)  # every rank or none: a collective needs them all
        self.actors = [
            LearnerActor.options(  # type: ignore[attr-defined]
                num_cpus=1,
                num_gpus=num_gpus_per_rank,
                resources=dict(ray_resources or {}) or None,
                scheduling_strategy=in_gang(self.group, rank),
            ).remote(settings, rank, world_size)
            for rank in range(world_size)
        ]

    async def initialize(self) -> None:
        """Waits for Ray to place every rank (failing, naming `resources.learner_gpus`, if it cannot),
        then builds them around a rendezvous on rank 0's node, wherever that is."""
        await placed(
            self.actors,
            what=f"{len(self.actors)} learner rank(s)",
            demand=self.demand,
            field="resources.learner_gpus",
            timeout_s=self.placement_timeout_s,
            group=self.group,
        )
        master = await self.actors[0].rendezvous_address.remote()
        await asyncio.gather(*(a.initialize.remote(master) for a in self.actors))

    async def check_storage(self, run_dir: str, token: str) -> None:
        """Every rank writes its shard of each checkpoint into the run dir: each must see it."""
        await asyncio.gather(*(a.check_storage.remote(run_dir, token) for a in self.actors))

    async def train_step(self, minibatches: list[list[LLMCall]]) -> dict[str, float]:
        """Each mini-batch is split across ranks by prompt group, so a group's rollouts (the reward
        baseline's support) and a rollout's segments stay on one rank; every rank normalises its loss
        by the whole mini-batch's trained tokens, so N ranks make the update one rank would."""
        if len(self.actors) == 1:
            return await self.actors[0].train_step.remote(minibatches)
        shards = self._shards(minibatches)
        tokens = [trained_tokens(minibatch) for minibatch in minibatches]
        results = await asyncio.gather(
            *(actor.train_step.remote(part, tokens) for actor, part in zip(self.actors, shards, strict=True))
        )
        return reduce_rank_metrics(list(results))

    def _shards(self, minibatches: list[list[LLMCall]]) -> list[list[list[LLMCall]]]:
        ranks = len(self.actors)
        shards: list[list[list[LLMCall]]] = [[] for _ in range(ranks)]
        for minibatch in minibatches:
            groups = sorted({s.group_id for s in minibatch})
            if len(groups) < ranks:
                raise ValueError(
                    f"a mini-batch of {len(groups)} prompt groups cannot feed {ranks} learner ranks "
                    "(raise ppo_mini_batch_size or lower resources.learner_gpus)"
                )
            owner = {group: index % ranks for index, group in enumerate(groups)}
            for rank in range(ranks):
                shards[rank].append([s for s in minibatch if owner[s.group_id] == rank])
        return shards

    async def compute_logprobs(self, segments: list[LLMCall]) -> list[list[float]]:
        """Rank 0's logprobs; every rank forwards the same segments (a ZeRO-3 forward is collective)."""
        results = await asyncio.gather(*(a.compute_logprobs.remote(segments) for a in self.actors))
        return results[0]

    async def export_weights(self, kinds: list[str]) -> dict[str, WeightHandoff]:
        """Rank 0's handoffs; every rank takes part (a ZeRO-3 gather is collective)."""
        results = await asyncio.gather(*(a.export_weights.remote(kinds) for a in self.actors))
        return results[0]

    async def adapter_files(self) -> dict[str, bytes]:
        """Rank 0's LoRA adapter files (`Learner.adapter_files`); every rank takes part (a ZeRO-3
        gather is collective)."""
        results = await asyncio.gather(*(a.adapter_files.remote() for a in self.actors))
        return results[0]

    async def release_weights(self, handoffs: list[WeightHandoff]) -> None:
        await self.actors[0].release_weights.remote(handoffs)

    async def usage(self) -> dict[str, float]:
        """Every rank's CPU-seconds so far and GPUs held, added up (metering)."""
        ranks = await asyncio.gather(*(a.usage.remote() for a in self.actors))
        return {key: float(sum(rank[key] for rank in ranks)) for key in ("cpu_s", "gpus")}

    async def node_id(self) -> str:
        """Rank 0's node, where the handoffs are made."""
        return await self.actors[0].node_id.remote()

    async def save_checkpoint(self, directory: str) -> None:
        """Every rank takes part (its optimizer shard; ZeRO-3's gather of the student is collective)."""
        await asyncio.gather(*(a.save_checkpoint.remote(directory) for a in self.actors))

    async def load_checkpoint(self, directory: str) -> None:
        await asyncio.gather(*(a.load_checkpoint.remote(directory) for a in self.actors))

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        with contextlib.suppress(Exception):  # already gone when the ranks could not be placed
            ray.util.remove_placement_group(self.group)
