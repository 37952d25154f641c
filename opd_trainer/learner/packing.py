"""The learner's plain forward without padding: a batch's rows concatenated into one row.

Where no shared-prefix plan runs (`batch.scored_logits` with `plan=None`: gradient checkpointing, or
ZeRO-3 ranks whose plans differ), the padded batch [B, W] forwards B × W positions, W = the longest
prompt + the longest completion. Packed, the model forwards each row's own tokens once, [1, ΣL]:
`position_ids` restart at 0 at every row, and with no `attention_mask` and no cache transformers reads
the restarts as packed sequences (`masking_utils.find_packed_sequence_indices`) and keeps attention
within each row (a block-diagonal causal mask under sdpa and eager). Logits are computed only at
the positions that predict completion tokens, read straight into the padded layout [B, S, V] that
the estimators take (`logits_to_keep` as indices).

Under sdpa and eager the mask is dense: attention reads (ΣL)² query-key pairs where the padded batch
reads B × W², so packing pays only where the weights' work saved exceeds the attention's added
(`packing_saves`). Flash attention would read Σ L² (variable-length kernels from the same positions)
but is not checked here (no GPU in the unit tests): it takes the padded forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from opd_trainer.learner.batch import LearnerBatch

PACKED_ATTENTION = ("sdpa", "eager")
"""Attention implementations whose masks transformers builds from restarting `position_ids` (checked
in tests/unit/test_packed_forward.py; sdpa is what `from_pretrained` picks on CPU and GPU). Any other
takes the padded forward."""


def model_config(model: Any) -> Any:
    """The Hugging Face config of `model`, whatever wraps it (a DeepSpeed engine, a PEFT model); None
    for a callable that is no module (then the padded forward runs)."""
    from transformers import PreTrainedConfig

    for module in model.modules() if isinstance(model, torch.nn.Module) else ():
        config = getattr(module, "config", None)
        if isinstance(config, PreTrainedConfig):
            return config
    return None


def packing_saves(batch: LearnerBatch, config: Any) -> bool:
    """Whether the packed forward of `batch` costs less than the padded one, for a model of `config`.

    Per layer, a position costs its projections and MLP, ~ 4·H² + 3·H·I multiply-adds (H hidden, I
    intermediate size), and each query-key pair it attends ~ 2·H (scores and weighted values). Rows
    of equal length with equal prompts have no padding: nothing to save, the padded forward runs.
    """
    if config is None or getattr(config, "_attn_implementation", None) not in PACKED_ATTENTION:
        return False
    rows, width = batch.input_ids_B_T.shape
    total = sum(batch.lengths)
    if total >= rows * width:
        return False
    hidden = config.hidden_size
    per_position = 4 * hidden * hidden + 3 * hidden * getattr(config, "intermediate_size", 4 * hidden)
    per_pair = 2 * hidden
    padded = rows * width * per_position + rows * width * width * per_pair
    return total * per_position + total * total * per_pair < padded


def packed_scored_logits(model: Any, batch: LearnerBatch, device: Any) -> Tensor:
    """Logits [B, S, V] of `batch`'s scored positions (`batch.scored_logits`' layout: `[row, j]`
    predicts row's completion token j), from one forward of its rows packed into one row.

    Slots past a row's completion (which the loss never reads) repeat the logits of its last
    position, as the padded forward holds a padding position's there.
    """
    prompt_end = batch.first_scored_position + 1
    width = batch.input_ids_B_T.shape[1] - prompt_end
    ids, positions, keep = [], [], []
    offset = 0
    for row, (prompt_length, length) in enumerate(zip(batch.prompt_lengths, batch.lengths, strict=True)):
        ids.append(batch.input_ids_B_T[row, prompt_end - prompt_length : prompt_end - prompt_length + length])
        positions.append(torch.arange(length))
        completion = length - prompt_length
        # Completion token j is predicted at the row's position prompt_length − 1 + j.
        scored = torch.arange(width).clamp(max=max(completion - 1, 0)) + prompt_length - 1
        keep.append(offset + scored.clamp(min=0))
        offset += length
    logits = model(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat(positions)[None].to(device),
        # No mask and no cache: what makes transformers read the restarting positions as packed rows.
        attention_mask=None,
        use_cache=False,
        logits_to_keep=torch.cat(keep).to(device),
    ).logits
    return logits.view(len(batch.lengths), width, -1)
