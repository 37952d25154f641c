"""Training phases and greedy validation for the tiny chat models (CPU, a few minutes end to end).

Two facts shape this module:

* Every tool-routing conversation starts with the same system prompt and tool list (~600 tokens) and
  differs only in a ~70-token tail. Training and validation run that prefix once per batch, broadcast its
  KV cache to every row and run only the tails on top: the model computes exactly what it would on the
  full sequences (same positions, same causal attention) at a fraction of the cost.
* The task is mostly copying ids such as ``B-8181`` from the user turn into tool-call arguments. A small
  transformer only copies once it has grown induction heads, which supervised training on the task alone
  takes ~1000 steps to find. A short phase on a synthetic copy task (random tokens, then the same tokens
  again) grows them in a few hundred cheap steps, standing in for the pretraining a real base model has.

Shapes: B rows, P shared prefix tokens, T tail tokens (right-padded), V vocabulary.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import DynamicCache, PreTrainedModel

from opd_trainer.demo.tiny_models.tokenizer import IM_END, PAD_TOKEN, SPECIAL_TOKENS, TOOL_TOKENS, render_chat
from opd_trainer.demo.tool_routing import evaluator
from opd_trainer.demo.tool_routing.task import Sample

logger = logging.getLogger(__name__)

Metrics = dict[str, float]
ProgressFn = Callable[[dict[str, Any]], None]
IGNORE = -100


@dataclass(frozen=True)
class Example:
    """One conversation as token ids after the shared prefix."""

    prompt_ids: tuple[int, ...]  # up to and including "<|im_start|>assistant\n"
    reply_ids: tuple[int, ...]  # the reference reply, up to and including <|im_end|>
    record: dict[str, Any]


@dataclass(frozen=True)
class Dataset:
    prefix_ids: tuple[int, ...]
    train: list[Example]
    validation: list[Example]

    @property
    def max_length(self) -> int:
        """Longest full conversation (prefix + prompt + reply) in tokens."""
        tails = [len(e.prompt_ids) + len(e.reply_ids) for e in (*self.train, *self.validation)]
        return len(self.prefix_ids) + max(tails)


@dataclass(frozen=True)
class CopyConfig:
    """Synthetic copy phase: stop once the running loss on the repeated half is below `target_loss`."""

    max_steps: int = 4000  # a safety cap only: the phase stops on the target (~900 steps measured)
    target_loss: float = 0.5
    batch_size: int = 32
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    min_len: int = 4
    max_len: int = 16


@dataclass(frozen=True)
class SftConfig:
    """Supervised phase on the reference replies; `with_system_prompt=False` trains on the tails alone.

    The learning rate follows warm-up + cosine decay over `schedule_steps` and then stays at its floor;
    `max_steps` only caps a phase that stops on a validation target, so a build whose float rounding
    makes it learn a little slower (another CPU, another thread count) trains longer instead of
    stopping short of the target.
    """

    max_steps: int
    schedule_steps: int | None = None  # None: decay over max_steps
    batch_size: int = 32
    learning_rate: float = 2e-3
    with_system_prompt: bool = True
    warmup_steps: int = 20
    weight_decay: float = 0.01
    min_lr_ratio: float = 0.1


@dataclass
class PhaseResult:
    name: str
    steps: int
    wall_time_s: float
    last_loss: float
    metrics: Metrics = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)


def encode_dataset(tokenizer: Tokenizer, train: Sequence[Sample], validation: Sequence[Sample]) -> Dataset:
    """Tokenize prompts and reference replies the way the engines will see them.

    Prompt and reply are encoded separately, as at inference time where the prompt is tokenized alone and
    the reply is generated token by token.
    """
    first = train[0].record
    prefix_ids = tuple(tokenizer.encode(render_chat(first["messages"][:1], first["tools"])).ids)

    def encode(sample: Sample) -> Example:
        messages, tools = sample.record["messages"], sample.record["tools"]
        prompt = render_chat(messages, tools, add_generation_prompt=True)
        full = render_chat([*messages, sample.reference_message], tools)
        if not full.startswith(prompt):
            raise ValueError(f"chat template is not prefix-stable for {sample.record['rollout_extra']}")
        reply = full[len(prompt) : full.index(IM_END, len(prompt)) + len(IM_END)]
        prompt_ids = tokenizer.encode(prompt).ids
        if tuple(prompt_ids[: len(prefix_ids)]) != prefix_ids:
            raise ValueError("samples do not share the system prompt and tools; prefix sharing needs them")
        return Example(
            tuple(prompt_ids[len(prefix_ids) :]), tuple(tokenizer.encode(reply).ids), sample.record
        )

    return Dataset(prefix_ids, [encode(s) for s in train], [encode(s) for s in validation])


def _prefix_cache(model: PreTrainedModel, prefix_ids: Sequence[int], rows: int) -> DynamicCache | None:
    if not prefix_ids:
        return None
    cache = DynamicCache(config=model.config)
    model(torch.tensor([list(prefix_ids)]), past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(rows)
    return cache


def _optimizer(model: PreTrainedModel, learning_rate: float, weight_decay: float) -> torch.optim.AdamW:
    # Norm gains and the (tied) embedding stay out of weight decay, as usual for transformers.
    params = list(model.named_parameters())
    decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in params if not (p.ndim >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.98))


def _warmup_cosine(warmup: int, total: int, floor: float) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _update(
    model: PreTrainedModel, loss: torch.Tensor, optimizer: torch.optim.Optimizer, schedule: Any
) -> None:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)


def pretrain_copying(
    model: PreTrainedModel, vocab_size: int, config: CopyConfig, seed: int, progress: ProgressFn | None = None
) -> PhaseResult:
    """Grow induction heads: rows are `x SEP x` for random tokens x, with loss on the second x only.

    The length of x varies per batch so that a fixed-offset attention head cannot solve it; only looking up
    the previous occurrence of the current token and copying its successor can.
    """
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    first = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)  # ordinary tokens only
    separator = 1  # <|im_start|>: never part of x
    optimizer = _optimizer(model, config.learning_rate, 0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / config.warmup_steps))
    model.train()
    running = float("inf")
    step = 0
    while step < config.max_steps and running > config.target_loss:
        n = int(torch.randint(config.min_len, config.max_len + 1, (1,), generator=generator))
        x_B_N = torch.randint(first, vocab_size, (config.batch_size, n), generator=generator)
        tokens_B_T = torch.cat([x_B_N, torch.full((config.batch_size, 1), separator), x_B_N], dim=1)
        targets_B_T = torch.full_like(tokens_B_T, IGNORE)
        targets_B_T[:, n : 2 * n] = x_B_N  # logit t predicts token t+1: the first x predicts nothing
        logits_B_T_V = model(tokens_B_T).logits
        loss = F.cross_entropy(logits_B_T_V.flatten(0, 1), targets_B_T.flatten(), ignore_index=IGNORE)
        _update(model, loss, optimizer, schedule)
        step += 1
        # The loss jumps between batches (x length varies), so stop on a running mean, not one batch.
        running = loss.item() if step == 1 else 0.9 * running + 0.1 * loss.item()
        if step % 50 == 0:
            logger.info("copy step %d loss %.3f (running %.3f)", step, loss.item(), running)
        if progress is not None:
            progress({"phase": "copy", "step": step, "loss": loss.item()})
    return PhaseResult("copy", step, time.perf_counter() - started, running)


def _batches(lengths: Sequence[int], batch_size: int, generator: torch.Generator) -> list[list[int]]:
    """One epoch of shuffled batches, each cut from a window of similar-length rows to limit padding."""
    order = torch.randperm(len(lengths), generator=generator).tolist()
    window = 8 * batch_size
    batches: list[list[int]] = []
    for lo in range(0, len(order) - batch_size + 1, window):
        rows = sorted(order[lo : lo + window], key=lambda i: lengths[i])
        batches += [rows[i : i + batch_size] for i in range(0, len(rows) - batch_size + 1, batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def reply_loss(
    model: PreTrainedModel, prefix_ids: Sequence[int], rows: Sequence[Example], pad_id: int
) -> torch.Tensor:
    """Mean cross-entropy over the reply tokens of `rows`; prompt and padding carry no loss."""
    seqs = [(*e.prompt_ids, *e.reply_ids) for e in rows]
    width = max(map(len, seqs))
    tokens_B_T = torch.full((len(rows), width), pad_id)
    targets_B_T = torch.full((len(rows), width), IGNORE)
    for i, (e, seq) in enumerate(zip(rows, seqs, strict=True)):
        tokens_B_T[i, : len(seq)] = torch.tensor(seq)
        # Logit t predicts token t+1, so the reply's targets sit one to the left of its tokens.
        targets_B_T[i, len(e.prompt_ids) - 1 : len(seq) - 1] = torch.tensor(e.reply_ids)
    # Right padding needs no attention mask: real tokens only attend to earlier, real ones.
    cache = _prefix_cache(model, prefix_ids, len(rows))
    logits_B_T_V = model(tokens_B_T, past_key_values=cache, use_cache=cache is not None).logits
    return F.cross_entropy(logits_B_T_V.flatten(0, 1), targets_B_T.flatten(), ignore_index=IGNORE)


@torch.no_grad()
def generate_replies(
    model: PreTrainedModel,
    prefix_ids: Sequence[int],
    prompts: Sequence[Sequence[int]],
    eos_ids: Sequence[int],
    pad_id: int,
    max_new_tokens: int = 64,
    batch_size: int = 32,
) -> list[list[int]]:
    """Greedy completions with HF `generate` for prompts that all start with `prefix_ids`.

    The tails are left-padded after the prefix (the padding sits in the middle, masked out); `generate`
    derives positions from the attention mask and skips the tokens the prefix cache already holds. Each
    completion is cut after its first end-of-sequence token. Small batches are faster here: the cache
    grows by concatenation every step, and a small one stays in the CPU caches.
    """
    model.eval()
    out: list[list[int]] = []
    for lo in range(0, len(prompts), batch_size):
        chunk = prompts[lo : lo + batch_size]
        width = max(map(len, chunk))
        tails_B_T = torch.full((len(chunk), width), pad_id)
        mask_B_T = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            tails_B_T[i, width - len(p) :] = torch.tensor(p)
            mask_B_T[i, width - len(p) :] = 1
        prefix_B_P = torch.tensor([list(prefix_ids)], dtype=torch.long).expand(len(chunk), -1)
        generated = model.generate(
            input_ids=torch.cat([prefix_B_P, tails_B_T], dim=1),
            attention_mask=torch.cat([torch.ones_like(prefix_B_P), mask_B_T], dim=1),
            past_key_values=_prefix_cache(model, prefix_ids, len(chunk)),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(eos_ids),
            pad_token_id=pad_id,
        )
        for row in generated[:, len(prefix_ids) + width :].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
            out.append(row[:cut])
    return out


def evaluate(
    model: PreTrainedModel, tokenizer: Tokenizer, data: Dataset, max_new_tokens: int = 64
) -> Metrics:
    """Greedy validation metrics from the tool-routing evaluator (exact_match, format_validity, ...)."""
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    eos_ids = [tokenizer.token_to_id(IM_END), pad_id]
    prompts = [e.prompt_ids for e in data.validation]
    replies = generate_replies(model, data.prefix_ids, prompts, eos_ids, pad_id, max_new_tokens)
    # Decoded as vLLM does by default: special tokens dropped, <tool_call> markers (not special) kept.
    texts = tokenizer.decode_batch(replies, skip_special_tokens=True)
    return evaluator.evaluate_texts(texts, [e.record for e in data.validation])


def train_replies(
    name: str,
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    data: Dataset,
    config: SftConfig,
    seed: int,
    validate_at: Callable[[int], bool] = lambda _: False,
    on_validate: Callable[[int, Metrics], None] | None = None,
    done: Callable[[Metrics], bool] = lambda _: False,
    progress: ProgressFn | None = None,
) -> PhaseResult:
    """Supervised training on the reference replies until `done(validation metrics)` or `max_steps`.

    After each step s with `validate_at(s)` the model is validated (always with the system prompt) and
    `on_validate(s, metrics)` called, which may copy the weights. `metrics` in the result are those of the
    last validation, i.e. of the weights left in `model` whenever the phase stopped on `done`.
    """
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    prefix_ids = data.prefix_ids if config.with_system_prompt else ()
    optimizer, schedule = _sft_optimizer(model, config)
    lengths = [len(e.prompt_ids) + len(e.reply_ids) for e in data.train]
    result = PhaseResult(name, 0, 0.0, float("nan"))
    batches: list[list[int]] = []
    while result.steps < config.max_steps:
        if not batches:
            batches = _batches(lengths, config.batch_size, generator)
        model.train()
        loss = reply_loss(model, prefix_ids, [data.train[i] for i in batches.pop()], pad_id)
        _update(model, loss, optimizer, schedule)
        result.steps += 1
        result.last_loss = loss.item()
        step = result.steps
        event: dict[str, Any] = {"phase": name, "step": step, "loss": result.last_loss}
        validate = validate_at(step)
        if validate:
            _validate(model, tokenizer, data, result)
            event |= result.metrics
            if on_validate is not None:
                on_validate(step, result.metrics)
            _log_validation(result, time.perf_counter() - started)
        elif step % 25 == 0:
            logger.info("%s step %d loss %.4f", name, step, result.last_loss)
        if progress is not None:
            progress(event)
        if validate and done(result.metrics):
            break
    result.wall_time_s = time.perf_counter() - started
    return result


def _sft_optimizer(
    model: PreTrainedModel, config: SftConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with warm-up, cosine decay over `schedule_steps` (else `max_steps`), then the floor rate."""
    optimizer = _optimizer(model, config.learning_rate, config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        _warmup_cosine(config.warmup_steps, config.schedule_steps or config.max_steps, config.min_lr_ratio),
    )
    return optimizer, schedule


def _validate(model: PreTrainedModel, tokenizer: Tokenizer, data: Dataset, result: PhaseResult) -> None:
    """Greedy validation after `result.steps` steps, kept as `result.metrics` and added to its history."""
    result.metrics = evaluate(model, tokenizer, data)
    result.history.append({"step": float(result.steps), "loss": result.last_loss, **result.metrics})


def _log_validation(result: PhaseResult, elapsed_s: float) -> None:
    logger.info(
        "%s step %d loss %.4f exact_match %.3f format_validity %.3f (%.0fs)",
        result.name,
        result.steps,
        result.last_loss,
        result.metrics["exact_match"],
        result.metrics["format_validity"],
        elapsed_s,
    )
