"""The learner's forward with shared prompt prefixes computed once.

A mini-batch's rows are (prompt + completion) sequences. Completions of one prompt (`n_rollouts`) share
the whole prompt, and prompts often share a long system / tools preamble. A plain padded forward runs
every row's prompt through the model again; here the forward is a two-level prefix tree:

1. **shared**: the tokens every row starts with, forwarded once (batch 1);
2. **group**: rows whose prompts are equal up to their last token form a group; each group's prompt
   after the shared part is forwarded once (batch = groups, right-padded), attending to (1) through
   its key/value cache expanded to the groups;
3. **row**: each row's last prompt token and its completion (batch = rows, right-padded), attending to
   its group's cache.

Only level 3 computes logits, exactly at the positions that predict completion tokens. The caches keep
their autograd graph, so gradients reach levels 1 and 2 summed over the rows that read them: loss and
gradients equal the plain forward's within float tolerance (tests/unit/test_shared_prefix.py), while the
learner's work grows with completion tokens instead of `rows × prompt length`.

Positions are passed explicitly (rotary embeddings see each token's true position) and the key mask
hides the padding inside the cache, so any Hugging Face causal LM that takes `past_key_values`,
`position_ids` and a 2-D `attention_mask` over past + new keys runs it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PrefixPlan:
    """How one batch's rows are forwarded; built from token ids alone (`plan_prefixes`)."""

    shared_ids: list[int]
    """Level 1: the tokens every row starts with."""
    group_ids: list[list[int]]
    """Level 2, per group: its prompt (minus the last token) after the shared tokens."""
    group_of_row: list[int]
    row_ids: list[list[int]]
    """Level 3, per row: its last prompt token and every completion token but the last."""
    row_start: list[int]
    """Position in the row's sequence of `row_ids[row][0]` (its prompt length − 1)."""

    @property
    def forwarded_tokens(self) -> int:
        """Tokens the model runs (padding excluded): the learner's work, FLOPs ∝ this."""
        return len(self.shared_ids) + sum(map(len, self.group_ids)) + sum(map(len, self.row_ids))

    @property
    def attended_keys(self) -> int:
        """Σ over forwarded tokens of the keys each attends to (itself and every earlier position):
        the attention's work, as `forwarded_tokens` is the weights'."""
        shared = len(self.shared_ids)
        keys = causal_keys(0, shared) + sum(causal_keys(shared, len(group)) for group in self.group_ids)
        return keys + sum(
            causal_keys(start, len(row)) for start, row in zip(self.row_start, self.row_ids, strict=True)
        )


def causal_keys(start: int, length: int) -> int:
    """Σ of (position + 1) over `length` tokens from position `start`: keys a causal forward reads."""
    return length * start + length * (length + 1) // 2


def _common_prefix_length(sequences: list[list[int]]) -> int:
    shortest = min(map(len, sequences))
    for position in range(shortest):
        token = sequences[0][position]
        if any(sequence[position] != token for sequence in sequences):
            return position
    return shortest


def plan_prefixes(prompts: list[list[int]], completions: list[list[int]]) -> PrefixPlan | None:
    """The prefix tree of a batch, or None where it cannot help (a one-token prompt: no prefix)."""
    if not prompts or min(map(len, prompts)) < 2:
        return None
    keys: dict[tuple[int, ...], int] = {}
    group_of_row = [keys.setdefault(tuple(prompt[:-1]), len(keys)) for prompt in prompts]
    group_keys = [list(key) for key in keys]
    shared = _common_prefix_length(group_keys)
    return PrefixPlan(
        shared_ids=group_keys[0][:shared],
        group_ids=[key[shared:] for key in group_keys],
        group_of_row=group_of_row,
        # A row with no completion still forwards its last prompt token (an unread position).
        row_ids=[
            prompt[-1:] + completion[:-1] for prompt, completion in zip(prompts, completions, strict=True)
        ],
        row_start=[len(prompt) - 1 for prompt in prompts],
    )


def model_calls(plan: PrefixPlan | None) -> int:
    """How many times the forward of `plan` calls the model (`shared_prefix_logits`; None: the plain
    forward, once). Under ZeRO-3 each call gathers parameters collectively, so ranks compare it."""
    if plan is None:
        return 1
    return 1 + bool(plan.shared_ids) + any(plan.group_ids)


def _right_padded(rows: list[list[int]], device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, W] and 0/1 key mask [N, W] of token lists padded on the right with 0."""
    # Lazy: torch loads only when a prefix is forwarded (the planning half is torch-free).
    import torch

    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[index, : len(row)] = 1
    return ids.to(device), mask.to(device)


def _select_rows(cache: Any, rows: list[int], device: Any) -> None:
    """Makes row i of every cached key/value tensor the cache's row `rows[i]`, with the gradient of each
    copy reaching its source (`DynamicCache.batch_select_indices`' meaning).

    `batch_select_indices` indexes (`keys[rows]`), whose backward scatters with accumulation, slow on
    CPU (2.2 ms a tensor in a batch-8 step of the tiny student). The usual selections are cheaper as
    views: the same rows in order (one completion per prompt) is no selection, and each row repeated
    r times in order (the shared prefix to every group, a prompt to its `n_rollouts` rows) is an
    expand, whose backward is a sum. Other selections, and caches other than plain `DynamicLayer`s
    (sliding windows, indexers: state of their own), keep `batch_select_indices`."""
    # Lazy: torch loads only when a prefix is forwarded (the planning half is torch-free).
    import torch
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    cached = layers[0].keys.shape[0] if layers and type(layers[0]) is DynamicLayer else 0
    repeats = len(rows) // cached if cached and len(rows) % cached == 0 else 0
    in_order = repeats > 0 and rows == [row for row in range(cached) for _ in range(repeats)]
    if not in_order or any(type(layer) is not DynamicLayer for layer in layers):
        cache.batch_select_indices(torch.tensor(rows, dtype=torch.long, device=device))
        return
    if repeats == 1:
        return
    for layer in layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            expanded = tensor.unsqueeze(1).expand(cached, repeats, *tensor.shape[1:])
            setattr(layer, name, expanded.reshape(cached * repeats, *tensor.shape[1:]))


def shared_prefix_logits(model: Any, plan: PrefixPlan, device: Any) -> torch.Tensor:
    """Logits [rows, W, V] of level 3: `[row, j]` predicts completion token j of that row."""
    # Lazy: torch loads only when a prefix is forwarded (the planning half is torch-free).
    import torch

    cache = None
    key_mask_parts: list[torch.Tensor] = []
    n_groups = len(plan.group_ids)
    if plan.shared_ids:
        ids = torch.tensor([plan.shared_ids], dtype=torch.long, device=device)
        cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
        # The selection is differentiable: the copies' gradients add up in the prefix's graph.
        _select_rows(cache, [0] * n_groups, device)
        key_mask_parts.append(torch.ones(n_groups, len(plan.shared_ids), dtype=torch.long, device=device))
    if any(plan.group_ids):
        ids, mask = _right_padded(plan.group_ids, device)
        positions = len(plan.shared_ids) + torch.arange(ids.shape[1], device=device).expand_as(ids)
        key_mask_parts.append(mask)
        cache = model(
            input_ids=ids,
            attention_mask=torch.cat(key_mask_parts, dim=1),
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).past_key_values
    row_index = torch.tensor(plan.group_of_row, dtype=torch.long, device=device)
    if cache is not None:
        _select_rows(cache, plan.group_of_row, device)
    key_mask = [part.index_select(0, row_index) for part in key_mask_parts]
    ids, mask = _right_padded(plan.row_ids, device)
    starts = torch.tensor(plan.row_start, dtype=torch.long, device=device)
    positions = starts[:, None] + torch.arange(ids.shape[1], device=device)
    return model(
        input_ids=ids,
        attention_mask=torch.cat([*key_mask, mask], dim=1),
        position_ids=positions,
        past_key_values=cache,
        use_cache=cache is not None,
    ).logits


def completion_logits(row_logits_N_W_V: torch.Tensor, width: int) -> torch.Tensor:
    """Level-3 logits as the batch holds its completions (`batch.LearnerBatch`: every row's first
    completion token at the same column): [rows, width, V], `[row, j]` predicting completion token j
    (zeros past a row's forwarded tokens: padding, which the loss never reads)."""
    # Lazy: torch loads only when a prefix is forwarded (the planning half is torch-free).
    import torch

    kept = row_logits_N_W_V[:, :width]
    return torch.nn.functional.pad(kept, (0, 0, 0, width - kept.shape[1]))
