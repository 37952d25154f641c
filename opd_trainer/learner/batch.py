"""One learner rank's mini-batch as a typed object, and the forward over it: pure functions of tensors
and a model, so that they are tested without Ray or DeepSpeed.

`pad_segments` turns the recorded LLM calls (`records.LLMCall`) into a `LearnerBatch`; `scored_logits`
runs the model over it (shared prompt prefixes once, `learner/shared_prefix.py`); `logprobs_of_targets`
reads the sampled tokens' logprobs off those logits; `LearnerBatch.distillation_inputs` hands the lot
to the estimator (`learner/estimators.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from opd_trainer.learner.estimators import DistillationInputs
from opd_trainer.learner.loss import gather_token_logprobs
from opd_trainer.learner.packing import model_config, packed_scored_logits, packing_saves
from opd_trainer.learner.preference_loss import pair_sides
from opd_trainer.learner.shared_prefix import (
    PrefixPlan,
    completion_logits,
    plan_prefixes,
    shared_prefix_logits,
)
from opd_trainer.records import LLMCall

if TYPE_CHECKING:
    from opd_trainer.learner.settings import LearnerSettings


@dataclass(frozen=True)
class LearnerBatch:
    """A mini-batch of segments (one LLM call's prompt + completion each), padded to width W = the
    longest prompt + the longest completion: each prompt ends at the same column, P = the longest
    prompt (padding before a shorter one), so every completion starts at column P (padding after).

    Per-token tensors (`_B_T`, T = W − 1) are aligned with `targets_B_T`: position t holds the value
    of the token predicted there (sequence token t + 1). Positions outside a row's completion hold 0,
    which the loss never reads (`mask_B_T` is 0 there). The learner's logits cover only positions
    P − 1 on (`first_scored_position`): the longest completion, however much the prompts' lengths
    differ (every vocabulary-wide op of the loss runs over those positions alone).
    """

    first_scored_position: int
    """P − 1: the position whose logits predict every row's first completion token."""
    input_ids_B_T: Tensor
    """[B, W] token ids, 0 before each row's prompt and after its completion."""
    attention_B_T: Tensor
    """[B, W] 1 on each row's tokens."""
    targets_B_T: Tensor
    """[B, W − 1] the token predicted at each position (`input_ids_B_T[:, 1:]`)."""
    mask_B_T: Tensor
    """[B, W − 1] 1 on the completion tokens the distillation loss trains on (rows of distilled calls)."""
    completion_mask_B_T: Tensor
    """[B, W − 1] 1 on every row's completion tokens: what the preference term sums over (a beacon's
    rewrite is a chosen action there, not a distilled row: `LLMCall.distilled`)."""
    sampler_B_T: Tensor
    teacher_B_T: Tensor
    rewards_B: Tensor
    """Each row's rollout reward (equal across a rollout's rows)."""
    group_ids_B: Tensor
    rollout_ids_B: Tensor
    hindsight_B: Tensor
    """Each row's hindsight value (`signal/hindsight.py`)."""
    preference_sides_B_P: Tensor
    """[B, P] +1 / −1 on each turn-level preference pair's chosen / rejected row, for the P pairs with
    both rows in this batch (`signal/pairs.py`; P = 0 when the job mines none)."""
    beacon_rows_B: Tensor
    """True on the rows that are kept beacon rewrites (`LLMCall.beacon`: `beacon_sft_coef`'s targets)."""
    prompt_lengths: tuple[int, ...]
    lengths: tuple[int, ...]
    """Each row's prompt + completion length."""
    stale_B: Tensor | None = None
    """True on rows sampled with older weights than the learner's now (`LLMCall.staleness` > 0)."""
    top_ids_B_T_K: Tensor | None = None
    """[B, W − 1, K] the teacher's top-k ids; None when the job asks for no top-k."""
    top_logprobs_B_T_K: Tensor | None = None

    def distillation_inputs(
        self,
        logits_B_S_V: Tensor,
        learner_B_T: Tensor,
        row_advantages_B: Tensor | None,
        num_tokens: float | None,
    ) -> DistillationInputs:
        """What the estimator reads: this batch's per-token values, and the learner's logits
        (`scored_logits`) and logprobs (`logprobs_of_targets`) on it."""
        first = self.first_scored_position
        scored = self.top_ids_B_T_K is not None and self.top_logprobs_B_T_K is not None
        return DistillationInputs(
            mask_B_T=self.mask_B_T,
            sampler_B_T=self.sampler_B_T,
            teacher_B_T=self.teacher_B_T,
            learner_B_T=learner_B_T,
            logits_B_S_V=logits_B_S_V,
            first_scored_position=first,
            top_ids_B_S_K=self.top_ids_B_T_K[:, first:] if scored else None,  # type: ignore[index]
            top_logprobs_B_S_K=self.top_logprobs_B_T_K[:, first:] if scored else None,  # type: ignore[index]
            row_advantages_B=row_advantages_B,
            num_tokens=num_tokens,
            stale_B=self.stale_B,
        )


def pad_segments(segments: list[LLMCall], teacher_top_k: int, device: Any) -> LearnerBatch:
    """The batch of `segments` (prompts ending at one column, `LearnerBatch`), on `device`; with
    `teacher_top_k` > 0 every segment must carry the teacher's top-k, [completion tokens,
    teacher_top_k] (`hyper_parameters.teacher_top_k`)."""
    prompt_end = max(len(s.prompt_token_ids) for s in segments)
    width = prompt_end + max(len(s.completion_token_ids) for s in segments)
    ids = torch.zeros(len(segments), width, dtype=torch.long)
    attention = torch.zeros(len(segments), width, dtype=torch.long)
    mask = torch.zeros(len(segments), width - 1)
    sampler = torch.zeros(len(segments), width - 1)
    teacher = torch.zeros(len(segments), width - 1)
    # Completion token k sits at column P + k and is predicted from position P + k − 1.
    first = prompt_end - 1
    for row, segment in enumerate(segments):
        prompt, completion = segment.prompt_token_ids, segment.completion_token_ids
        start = prompt_end - len(prompt)
        ids[row, start : prompt_end + len(completion)] = torch.tensor(prompt + completion)
        attention[row, start : prompt_end + len(completion)] = 1
        end = first + len(completion)
        mask[row, first:end] = 1.0
        sampler[row, first:end] = torch.tensor(segment.sampler_logprobs)
        teacher[row, first:end] = torch.tensor(segment.teacher_logprobs)
    top_ids, top_logprobs = (
        _pad_top_k(segments, teacher_top_k, width - 1, first) if teacher_top_k else (None, None)
    )
    return LearnerBatch(
        first_scored_position=first,
        input_ids_B_T=ids.to(device),
        attention_B_T=attention.to(device),
        targets_B_T=ids[:, 1:].to(device),
        mask_B_T=(mask * torch.tensor([[float(s.distilled)] for s in segments])).to(device),
        completion_mask_B_T=mask.to(device),
        sampler_B_T=sampler.to(device),
        teacher_B_T=teacher.to(device),
        rewards_B=torch.tensor([s.reward for s in segments], device=device),
        stale_B=torch.tensor([s.staleness > 0 for s in segments], device=device),
        group_ids_B=torch.tensor([s.group_id for s in segments], device=device),
        rollout_ids_B=torch.tensor([s.rollout_id for s in segments], device=device),
        hindsight_B=torch.tensor([s.hindsight for s in segments], device=device),
        preference_sides_B_P=pair_sides([s.preference_pairs for s in segments], device),
        beacon_rows_B=torch.tensor([bool(s.beacon) for s in segments], device=device),
        prompt_lengths=tuple(len(s.prompt_token_ids) for s in segments),
        lengths=tuple(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in segments),
        top_ids_B_T_K=None if top_ids is None else top_ids.to(device),
        top_logprobs_B_T_K=None if top_logprobs is None else top_logprobs.to(device),
    )


def _pad_top_k(segments: list[LLMCall], top_k: int, width: int, first: int) -> tuple[Tensor, Tensor]:
    """The teacher's top-k ids / logprobs, [B, width, K], aligned like `pad_segments`' tensors (each
    row's first completion token predicted at position `first`).

    Positions without a teacher score hold id 0 and logprob 0: the loss mask is 0 there, and the
    loss functions never read masked positions.
    """
    ids_B_T_K = torch.zeros(len(segments), width, top_k, dtype=torch.long)
    logprobs_B_T_K = torch.zeros(len(segments), width, top_k)
    for row, segment in enumerate(segments):
        expected = (len(segment.completion_token_ids), top_k)
        shapes = {
            tuple(array.shape) if array is not None else None
            for array in (segment.teacher_top_ids, segment.teacher_top_logprobs)
        }
        if shapes != {expected}:
            raise ValueError(
                f"segment {row} carries the teacher's top-k with shapes {sorted(map(str, shapes))}, expected "
                f"{expected} (completion tokens, hyper_parameters.teacher_top_k)"
            )
        end = first + len(segment.completion_token_ids)
        # torch.tensor copies: arrays that arrive through Ray are read-only views of its object store.
        ids_B_T_K[row, first:end] = torch.tensor(segment.teacher_top_ids, dtype=torch.long)
        logprobs_B_T_K[row, first:end] = torch.tensor(segment.teacher_top_logprobs)
    return ids_B_T_K, logprobs_B_T_K


def prefix_plan(batch: LearnerBatch) -> PrefixPlan | None:
    """The shared-prefix forward's plan of `batch` (its rows' prompts and completions)."""
    prompt_end = batch.first_scored_position + 1
    prompts, completions = [], []
    for ids, prompt_length, length in zip(
        batch.input_ids_B_T.tolist(), batch.prompt_lengths, batch.lengths, strict=True
    ):
        prompts.append(ids[prompt_end - prompt_length : prompt_end])
        completions.append(ids[prompt_end : prompt_end + length - prompt_length])
    return plan_prefixes(prompts, completions)


def scored_logits(model: Any, batch: LearnerBatch, plan: PrefixPlan | None, device: Any) -> Tensor:
    """float32 logits [B, S, V] of the positions from `first_scored_position` on (S = T − that).

    With a `plan` (`prefix_plan`) shared prompt prefixes are forwarded once: prompts are ~95 % of a
    tiny model's tokens and mostly shared (one prompt per `n_rollouts` completions, one system
    preamble per batch); None takes the plain forward: its rows packed into one row without padding
    where that costs less (`learner/packing.py`: rows of different lengths), else padded. Logits are
    computed only where a completion token is predicted.
    """
    width = batch.input_ids_B_T.shape[1] - 1 - batch.first_scored_position
    if plan is None and packing_saves(batch, model_config(model)):
        # Rows of different lengths: one padding-free row (`learner/packing.py`), same layout.
        return packed_scored_logits(model, batch, device).float()
    if plan is None:
        # Prompts are padded before their start: positions count from each row's first token.
        positions = (batch.attention_B_T.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(
            input_ids=batch.input_ids_B_T,
            attention_mask=batch.attention_B_T,
            position_ids=positions,
            logits_to_keep=width + 1,
        ).logits
        return logits[:, :-1].float()
    return completion_logits(shared_prefix_logits(model, plan, device), width).float()


def logprobs_of_targets(logits_B_S_V: Tensor, batch: LearnerBatch, temperature: float) -> Tensor:
    """[B, T] logprob of each target token at the sampling temperature, from `scored_logits`."""
    first = batch.first_scored_position
    scored = gather_token_logprobs(logits_B_S_V, batch.targets_B_T[:, first:], temperature)
    # Back to full width (zeros where nothing is scored; the loss mask is 0 there).
    return torch.nn.functional.pad(scored, (first, 0))


def row_advantages(settings: LearnerSettings, reward_adv_B: Tensor, hindsight_B: Tensor) -> Tensor | None:
    """Each row's weighted policy-gradient advantage: reward_coef × its group-baselined reward plus
    hindsight_coef × its turn's hindsight value (signal/hindsight.py); None when both weights are 0."""
    terms = [
        coef * values
        for coef, values in ((settings.reward_coef, reward_adv_B), (settings.hindsight_coef, hindsight_B))
        if coef > 0
    ]
    return sum(terms[1:], terms[0]) if terms else None
