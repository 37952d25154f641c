"""DeepSpeed learner actor: minimises the OPD loss on the student's own samples and publishes weights.

`Learner` is a plain class (one data-parallel rank); `LearnerActor` is it as a Ray actor and
`LearnerGroup` drives `world_size` ranks in lock-step (rank 0 publishes weights and checkpoints).

Hardware: fp32 + gloo with `DS_ACCELERATOR=cpu` on a CPU box; bf16 + NCCL, one GPU per rank, on CUDA.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from opd_trainer.engine.weight_sync import (
    SharedMemoryWeights,
    WeightHandoff,
    put_object_store_weights,
    release_shared_memory_weights,
    write_shared_memory_weights,
)
from opd_trainer.errors import WeightSyncError
from opd_trainer.learner.shared_prefix import (
    PrefixPlan,
    causal_keys,
    plan_prefixes,
    scatter_row_logits,
    shared_prefix_logits,
)
from opd_trainer.placement import gang, in_gang, placed
from opd_trainer.ports import free_port
from opd_trainer.records import LLMCall
from opd_trainer.shared_storage import check_probe

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearnerSettings:
    """What one learner rank needs; built by the job driver from the job spec."""

    model_path: str
    learning_rate: float
    lr_scheduler_type: str
    warmup_ratio: float
    weight_decay: float
    max_grad_norm: float
    total_updates: int
    """Optimizer updates over the whole job (steps × mini-batches per step); the schedule's length."""
    temperature: float
    kl_coef: float
    kl_loss_coef: float
    reward_coef: float
    normalize_reward_by_std: bool
    hindsight_coef: float
    ratio_cap: float
    zero_stage: int
    seed: int
    distill_loss: str
    """`hyper_parameters.distill_loss`: which estimator `distillation_loss` applies."""
    jsd_beta: float


def distillation_loss(
    settings: LearnerSettings,
    batch: dict[str, torch.Tensor],
    logits_B_S_V: torch.Tensor,
    learner_B_T: torch.Tensor,
    row_adv_B: torch.Tensor | None,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The `settings.distill_loss` estimator plus the per-row terms, and its stats (see learner/loss.py).

    `row_adv_B`: each row's advantage added to all its trained tokens through the policy gradient,
    already weighted (`row_advantages`: reward_coef × the group-baselined reward + hindsight_coef ×
    the turn's hindsight value), or None.

    `num_tokens`: the loss normaliser (None: this batch's trained tokens). A data-parallel rank passes
    the whole mini-batch's trained tokens over the number of ranks, so that the ranks' gradients,
    averaged by DeepSpeed, are the gradient of one token mean over the whole mini-batch.

    `batch` is `Learner._pad`'s; `logits_B_S_V` the learner's float logits from `first_scored_position`
    on and `learner_B_T` its logprobs of the targets at the sampling temperature (`Learner._scored_logits`,
    `Learner._logprobs_of_targets`). A plain function so that it is tested without DeepSpeed.

    `signal_std` is the spread over trained tokens of the per-token distillation signal: the sampled
    log-ratio (minus the baseline for `sampled_baseline`), or the per-position divergence of a top-k
    estimator. The top-k estimators and diagnostics see both models at temperature 1.
    """
    import torch

    from opd_trainer.learner import loss as opd_loss

    mask_B_T, sampler_B_T, teacher_B_T = batch["mask_B_T"], batch["sampler_B_T"], batch["teacher_B_T"]
    first = int(batch["first_scored_position"])
    top_k = None
    extra: dict[str, torch.Tensor] = {}
    if "teacher_top_ids_B_T_K" in batch:
        # The scored slice, aligned with logits_B_S_V.
        top_k = (
            batch["teacher_top_ids_B_T_K"][:, first:],
            batch["teacher_top_logprobs_B_T_K"][:, first:],
            mask_B_T[:, first:],
        )
        extra = opd_loss.topk_metrics(logits_B_S_V.detach(), *top_k)

    def full_width(values_B_S: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(values_B_S, (first, 0))

    if settings.distill_loss == "sampled":
        advantages_B_T = opd_loss.opd_advantages(
            sampler_B_T, teacher_B_T, mask_B_T, settings.kl_coef, row_adv_B, 1.0
        )
        loss, stats = opd_loss.policy_loss(
            learner_B_T, sampler_B_T, advantages_B_T, mask_B_T, settings.ratio_cap, num_tokens
        )
        signal_B_T = sampler_B_T - teacher_B_T
    elif top_k is None:
        raise ValueError(f"distill_loss {settings.distill_loss} needs the teacher's top-k in the batch")
    elif settings.distill_loss == "sampled_baseline":
        baseline_B_T = full_width(opd_loss.topk_signal_baseline(logits_B_S_V.detach(), *top_k))
        distill_B_T = opd_loss.sampled_baseline_advantages(
            sampler_B_T, teacher_B_T, baseline_B_T, mask_B_T, settings.kl_coef
        )
        advantages_B_T = opd_loss.add_reward_advantages(distill_B_T, mask_B_T, row_adv_B, 1.0)
        loss, stats = opd_loss.policy_loss(
            learner_B_T, sampler_B_T, advantages_B_T, mask_B_T, settings.ratio_cap, num_tokens
        )
        signal_B_T = sampler_B_T - teacher_B_T - baseline_B_T
    else:
        if settings.distill_loss == "topk_reverse":
            divergence, per_token_B_S = opd_loss.topk_reverse_kl_loss(logits_B_S_V, *top_k, num_tokens)
        elif settings.distill_loss == "topk_forward":
            divergence, per_token_B_S = opd_loss.topk_forward_kl_loss(logits_B_S_V, *top_k, num_tokens)
        else:
            divergence, per_token_B_S = opd_loss.topk_jsd_loss(
                logits_B_S_V, *top_k, beta=settings.jsd_beta, num_tokens=num_tokens
            )
        # The reward (and hindsight) still reach the student through the policy gradient (zero when none).
        zeros_B_T = torch.zeros_like(learner_B_T)
        advantages_B_T = opd_loss.add_reward_advantages(zeros_B_T, mask_B_T, row_adv_B, 1.0)
        policy, stats = opd_loss.policy_loss(
            learner_B_T, sampler_B_T, advantages_B_T, mask_B_T, settings.ratio_cap, num_tokens
        )
        loss = policy + settings.kl_coef * divergence
        signal_B_T = full_width(per_token_B_S)
    return loss, {**stats, **extra, "signal_std": opd_loss.signal_std(signal_B_T.detach(), mask_B_T)}


def prefix_plan(batch: dict[str, torch.Tensor]) -> PrefixPlan | None:
    """The shared-prefix forward's plan of a `Learner._pad` batch (its rows' prompts and completions)."""
    prompts, completions = [], []
    for ids, prompt_length, length in zip(
        batch["input_ids_B_T"].tolist(),
        batch["prompt_lengths_B"].tolist(),
        batch["lengths_B"].tolist(),
        strict=True,
    ):
        prompts.append(ids[:prompt_length])
        completions.append(ids[prompt_length:length])
    return plan_prefixes(prompts, completions)


def row_advantages(
    settings: LearnerSettings, reward_adv_B: torch.Tensor, hindsight_B: torch.Tensor
) -> torch.Tensor | None:
    """Each row's weighted policy-gradient advantage: reward_coef × its group-baselined reward plus
    hindsight_coef × its turn's hindsight value (learner/hindsight.py); None when both weights are 0."""
    terms = [
        coef * values
        for coef, values in ((settings.reward_coef, reward_adv_B), (settings.hindsight_coef, hindsight_B))
        if coef > 0
    ]
    return sum(terms[1:], terms[0]) if terms else None


# Our `lr_scheduler_type` names → transformers' schedules (linear warm-up from 0 in each).
HF_SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def lr_schedule(optimizer: Any, schedule: str, total_updates: int, warmup_updates: int) -> Any:
    """`transformers.get_scheduler`: linear warm-up over `warmup_updates`, then cosine or linear decay
    to 0 at `total_updates`, or constant."""
    from transformers import get_scheduler

    return get_scheduler(
        HF_SCHEDULES[schedule],
        optimizer,
        num_warmup_steps=warmup_updates,
        num_training_steps=total_updates,
    )


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
        self._device: torch.device | None = None

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
        import torch

        on_gpu = torch.cuda.is_available()
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
        import deepspeed
        from transformers import AutoModelForCausalLM

        if not on_gpu:
            # Ray sets OMP_NUM_THREADS to the actor's 1 CPU slot, which left torch one thread. On CPU the
            # learner runs while the engines wait for its weights (strictly on-policy), so it takes
            # every core this process may use (learner 3.13 s -> 1.88 s a step, benchmarks/step_breakdown.py).
            affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere all of the machine's
            torch.set_num_threads(len(affinity(0)) if affinity else os.cpu_count() or 1)
        torch.manual_seed(self.settings.seed)
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
        self._device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        dtype = torch.bfloat16 if on_gpu else torch.float32
        model = AutoModelForCausalLM.from_pretrained(
            self.settings.model_path, dtype=dtype, trust_remote_code=False
        )
        model.config.use_cache = False
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=self.settings.learning_rate, weight_decay=self.settings.weight_decay
        )
        total, schedule = self.settings.total_updates, self.settings.lr_scheduler_type
        warmup = round(self.settings.warmup_ratio * total)
        scheduler = lr_schedule(optimizer, schedule, total, warmup)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.settings.max_grad_norm,
            "zero_optimization": {"stage": self.settings.zero_stage},
            "bf16": {"enabled": on_gpu},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self._engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        if self.settings.kl_loss_coef > 0:
            # A frozen copy of the initial student for KL(learner ‖ initial); only paid for when used.
            self._reference = AutoModelForCausalLM.from_pretrained(
                self.settings.model_path, dtype=dtype, trust_remote_code=False
            )
            self._reference.to(self._device).eval().requires_grad_(False)
        logger.info(
            "learner rank %d/%d ready (ZeRO-%d)", self.rank, self.world_size, self.settings.zero_stage
        )

    # -- tensors --------------------------------------------------------------------------------

    def _pad(self, segments: list[LLMCall]) -> dict[str, torch.Tensor]:
        """Right-padded batch: ids, attention mask, loss mask on completion tokens, per-token values.

        Per-token tensors are aligned with `targets_B_T` (the token predicted at each position).
        """
        import torch

        lengths = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in segments]
        width = max(lengths)
        ids = torch.zeros(len(segments), width, dtype=torch.long)
        attention = torch.zeros(len(segments), width, dtype=torch.long)
        mask = torch.zeros(len(segments), width - 1)
        sampler = torch.zeros(len(segments), width - 1)
        teacher = torch.zeros(len(segments), width - 1)
        for row, segment in enumerate(segments):
            sequence = segment.prompt_token_ids + segment.completion_token_ids
            ids[row, : len(sequence)] = torch.tensor(sequence)
            attention[row, : len(sequence)] = 1
            # Completion token k sits at sequence position p+k and is predicted from position p+k-1.
            start = len(segment.prompt_token_ids) - 1
            end = start + len(segment.completion_token_ids)
            mask[row, start:end] = 1.0
            sampler[row, start:end] = torch.tensor(segment.sampler_logprobs)
            teacher[row, start:end] = torch.tensor(segment.teacher_logprobs)
        device = self._device
        batch = {
            # Position whose logits predict the earliest completion token of the batch.
            "first_scored_position": torch.tensor(min(len(s.prompt_token_ids) for s in segments) - 1),
            "input_ids_B_T": ids.to(device),
            "attention_B_T": attention.to(device),
            "targets_B_T": ids[:, 1:].to(device),
            "mask_B_T": mask.to(device),
            "sampler_B_T": sampler.to(device),
            "teacher_B_T": teacher.to(device),
            # Kept on the CPU: `_scored_logits` plans the shared-prefix forward from them.
            "prompt_lengths_B": torch.tensor([len(s.prompt_token_ids) for s in segments]),
            "lengths_B": torch.tensor(lengths),
        }
        if segments[0].teacher_top_ids is not None:
            batch.update(self._pad_top_k(segments, width - 1))
        return batch

    def _pad_top_k(self, segments: list[LLMCall], width: int) -> dict[str, torch.Tensor]:
        """The teacher's top-k ids / logprobs, [B, T, K], aligned with `targets_B_T` like `_pad`'s tensors.

        Positions without a teacher score hold id 0 and logprob 0: the loss mask is 0 there, and the
        loss functions never read masked positions.
        """
        import torch

        top_k = segments[0].teacher_top_ids.shape[1]  # type: ignore[union-attr]
        ids_B_T_K = torch.zeros(len(segments), width, top_k, dtype=torch.long)
        logprobs_B_T_K = torch.zeros(len(segments), width, top_k)
        for row, segment in enumerate(segments):
            if segment.teacher_top_ids is None or segment.teacher_top_logprobs is None:
                raise ValueError("every segment of a batch needs the teacher's top-k, or none does")
            start = len(segment.prompt_token_ids) - 1
            end = start + len(segment.completion_token_ids)
            # torch.tensor copies: arrays that arrive through Ray are read-only views of its object store.
            ids_B_T_K[row, start:end] = torch.tensor(segment.teacher_top_ids, dtype=torch.long)
            logprobs_B_T_K[row, start:end] = torch.tensor(segment.teacher_top_logprobs)
        return {
            "teacher_top_ids_B_T_K": ids_B_T_K.to(self._device),
            "teacher_top_logprobs_B_T_K": logprobs_B_T_K.to(self._device),
        }

    def _scored_logits(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 logits [B, S, V] of the positions from `first_scored_position` on (S = T − 1 − that).

        Shared prompt prefixes are forwarded once (`learner/shared_prefix.py`): prompts are ~95 % of a
        tiny model's tokens and mostly shared (one prompt per `n_rollouts` completions, one system
        preamble per batch). Logits are computed only where a completion token is predicted.
        """
        first = int(batch["first_scored_position"])
        width = batch["input_ids_B_T"].shape[1] - 1 - first
        plan = prefix_plan(batch)
        if plan is None:
            ids_B_T = batch["input_ids_B_T"]
            logits = model(
                input_ids=ids_B_T, attention_mask=batch["attention_B_T"], logits_to_keep=width + 1
            ).logits
            return logits[:, :-1].float()
        row_logits = shared_prefix_logits(model, plan, self._device)
        return scatter_row_logits(row_logits, plan, first, width).float()

    def _logprobs_of_targets(
        self, logits_B_S_V: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """[B, T] logprob of each target token at the sampling temperature, from `_scored_logits`."""
        import torch

        from opd_trainer.learner.loss import gather_token_logprobs

        first = int(batch["first_scored_position"])
        scored = gather_token_logprobs(
            logits_B_S_V, batch["targets_B_T"][:, first:], self.settings.temperature
        )
        # Back to full width (zeros where nothing is scored; the loss mask is 0 there).
        return torch.nn.functional.pad(scored, (first, 0))

    def _token_logprobs(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._logprobs_of_targets(self._scored_logits(model, batch), batch)

    def compute_logprobs(self, segments: list[LLMCall]) -> list[list[float]]:
        """The learner's logprob of each completion token (pre-flight drift probe, tests)."""
        import torch

        self.initialize()
        batch = self._pad(segments)
        with torch.no_grad():
            logprobs = self._token_logprobs(self._engine.module, batch).cpu()
        out = []
        for row, segment in enumerate(segments):
            start = len(segment.prompt_token_ids) - 1
            out.append(logprobs[row, start : start + len(segment.completion_token_ids)].tolist())
        return out

    # -- training -------------------------------------------------------------------------------

    def train_step(
        self, minibatches: list[list[LLMCall]], minibatch_tokens: list[float] | None = None
    ) -> dict[str, float]:
        """One OPD step: one optimizer update per mini-batch (this rank's share of each).

        Every rank must get the same number of mini-batches: each update is a collective.
        `minibatch_tokens[i]`: trained tokens of mini-batch i over all ranks (None: one rank), which
        normalises each rank's loss so that the averaged gradient is the whole mini-batch's.
        """
        import torch

        from opd_trainer.learner import loss as opd_loss

        self.initialize()
        if not minibatches or not all(minibatches):
            raise ValueError("train_step needs non-empty mini-batches")
        totals: dict[str, float] = {}
        ratio_max = 0.0
        forwarded = attended = 0
        grad_norms: list[float] = []
        for index, minibatch in enumerate(minibatches):
            num_tokens = None if minibatch_tokens is None else minibatch_tokens[index] / self.world_size
            batch = self._pad(minibatch)
            plan = prefix_plan(batch)
            if plan is None:
                forwarded += int(batch["lengths_B"].sum())
                attended += sum(causal_keys(0, length) for length in batch["lengths_B"].tolist())
            else:
                forwarded += plan.forwarded_tokens
                attended += plan.attended_keys
            rewards_B = torch.tensor([s.reward for s in minibatch], device=self._device)
            reward_adv_B = opd_loss.group_reward_advantages(
                rewards_B,
                torch.tensor([s.group_id for s in minibatch], device=self._device),
                torch.tensor([s.rollout_id for s in minibatch], device=self._device),
                self.settings.normalize_reward_by_std,
            )
            logits_B_S_V = self._scored_logits(self._engine, batch)
            learner_B_T = self._logprobs_of_targets(logits_B_S_V, batch)
            hindsight_B = torch.tensor([s.hindsight for s in minibatch], device=self._device)
            policy, stats = distillation_loss(
                self.settings,
                batch,
                logits_B_S_V,
                learner_B_T,
                row_advantages(self.settings, reward_adv_B, hindsight_B),
                num_tokens,
            )
            total = policy
            if self._reference is not None:
                with torch.no_grad():
                    reference_B_T = self._token_logprobs(self._reference, batch)
                kl_ref = opd_loss.kl_to_reference(learner_B_T, reference_B_T, batch["mask_B_T"], num_tokens)
                total = total + self.settings.kl_loss_coef * kl_ref
                totals["kl_to_initial"] = totals.get("kl_to_initial", 0.0) + float(kl_ref.detach())
            self._engine.backward(total)
            self._engine.step()
            grad_norm = self._engine.get_global_grad_norm()
            if grad_norm is not None:
                grad_norms.append(float(grad_norm))
            totals["loss"] = totals.get("loss", 0.0) + float(total.detach())
            # Per-token statistics of this rank's share, weighted by that share of the mini-batch's
            # tokens (1 with one rank), so that the ranks' plain mean is the mini-batch's token mean.
            share = 1.0 if num_tokens is None else float(batch["mask_B_T"].sum()) / num_tokens
            for name in (
                "ratio_mean",
                "ratio_truncated_frac",
                "signal_std",
                "teacher_topk_mass",
                "student_topk_mass",
            ):
                if name in stats:
                    totals[name] = totals.get(name, 0.0) + share * float(stats[name])
            ratio_max = max(ratio_max, float(stats["ratio_max"]))
        metrics = {name: value / len(minibatches) for name, value in totals.items()}
        metrics["ratio_max"] = ratio_max
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
        metrics["lr"] = float(self._engine.get_lr()[0])
        metrics["optimizer_updates"] = float(len(minibatches))
        # Tokens forwarded and back-propagated (shared prefixes once): the learner's work, FLOPs ∝ this.
        metrics["learner_tokens"] = float(forwarded)
        metrics["learner_attended_keys"] = float(attended)
        return metrics

    # -- weights and checkpoints ----------------------------------------------------------------

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Full (gathered) weights under Hugging Face names, as the engines load them.

        Tied tensors (e.g. `lm_head.weight` = `model.embed_tokens.weight`) appear once, under their
        first name, as in a tied checkpoint: the engine re-ties them on load.
        """
        import deepspeed

        module = self._engine.module

        def untied(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
            seen: set[int] = set()
            weights = []
            for name, tensor in state.items():
                if tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    weights.append((name, tensor.detach()))
            return weights

        if self.settings.zero_stage == 3:
            # Tied tensors are found while gathered (one storage), before the copies that outlive it.
            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                return [(n, t.cpu().clone()) for n, t in untied(module.state_dict())]
        return untied(module.state_dict())

    def export_weights(self, kinds: list[str]) -> dict[str, WeightHandoff]:
        """The current weights as one handoff per kind asked for ("shm": a tmpfs file on this node,
        "ray": Ray's object store), for the engine group to hand to its replicas. Every rank takes
        part (ZeRO-3 gathers the parameters collectively); rank 0's handoffs are the ones returned.
        Call `release_weights` once every engine has loaded them."""
        self.initialize()
        weights = self.named_weights()
        if self.rank != 0:
            return {}
        handoffs: dict[str, WeightHandoff] = {}
        for kind in sorted(set(kinds)):
            if kind == "shm":
                handoffs[kind] = write_shared_memory_weights(weights)
            elif kind == "ray":
                handoffs[kind] = put_object_store_weights(weights)
            else:
                raise WeightSyncError(f"unknown weight handoff kind {kind!r}")
        return handoffs

    def release_weights(self, handoffs: list[WeightHandoff]) -> None:
        """Frees what `export_weights` made (the tmpfs file; an object-store copy goes with its last
        reference)."""
        for handoff in handoffs:
            if isinstance(handoff, SharedMemoryWeights):
                release_shared_memory_weights(handoff)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def save_checkpoint(self, directory: str) -> None:
        """HF `save_pretrained` student (rank 0) + DeepSpeed optimizer/scheduler state (all ranks)."""
        self.initialize()
        path = Path(directory)
        self._engine.save_checkpoint(str(path / "deepspeed"), tag="state")
        if self.rank == 0:
            from transformers import AutoTokenizer

            self._engine.module.save_pretrained(str(path / "student"), state_dict=dict(self.named_weights()))
            AutoTokenizer.from_pretrained(self.settings.model_path, trust_remote_code=False).save_pretrained(
                str(path / "student")
            )

    def load_checkpoint(self, directory: str) -> None:
        self.initialize()
        self._engine.load_checkpoint(str(Path(directory) / "deepspeed"), tag="state")


# How `Learner.train_step`'s metrics combine across data-parallel ranks. Each rank normalises its
# loss terms by the mini-batch's tokens over the ranks and weights its per-token statistics by its
# share of those tokens, so the plain mean over ranks is the whole mini-batch's value (`signal_std`,
# a spread, is combined the same way: an approximation); counts add up.
SUMMED_METRICS = frozenset({"learner_tokens", "learner_attended_keys"})
MAXED_METRICS = frozenset({"ratio_max"})
SHARED_METRICS = frozenset({"grad_norm", "lr", "optimizer_updates"})  # equal on every rank


def trained_tokens(segments: list[LLMCall]) -> float:
    return float(sum(len(s.completion_token_ids) for s in segments))


def reduce_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from every rank's: summed, maxed, shared, else the mean over ranks."""
    reduced: dict[str, float] = {}
    for name in per_rank[0]:
        values = [metrics[name] for metrics in per_rank]
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
        return await self.actors[0].compute_logprobs.remote(segments)

    async def export_weights(self, kinds: list[str]) -> dict[str, WeightHandoff]:
        """Rank 0's handoffs; every rank takes part (a ZeRO-3 gather is collective)."""
        results = await asyncio.gather(*(a.export_weights.remote(kinds) for a in self.actors))
        return results[0]

    async def release_weights(self, handoffs: list[WeightHandoff]) -> None:
        await self.actors[0].release_weights.remote(handoffs)

    async def node_id(self) -> str:
        """Rank 0's node, where the handoffs are made."""
        return await self.actors[0].node_id.remote()

    async def save_checkpoint(self, directory: str) -> None:
        await asyncio.gather(*(a.save_checkpoint.remote(directory) for a in self.actors))

    async def load_checkpoint(self, directory: str) -> None:
        await asyncio.gather(*(a.load_checkpoint.remote(directory) for a in self.actors))

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        with contextlib.suppress(Exception):  # already gone when the ranks could not be placed
            ray.util.remove_placement_group(self.group)
