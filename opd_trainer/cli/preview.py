"""`opd preview FILE`: how the trainer reads a dataset, before a job is submitted.

Validates the whole file as a job would (every bad line, with its number), then shows the first `-n`
samples as the trainer hands them on: sample id, source line, the conversation, the tools' names, the
ground truth rewards receive and `rollout_extra`. With `--tokenizer` (the student's folder or Hugging
Face id) it also renders each prompt with the model's chat template and counts its tokens, and gives
the longest prompt of the file, which is what `max_length` must exceed. A task record (no `messages`)
is shown as written: a workflow function writes its prompt, so it has no prompt tokens to count.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from opd_trainer.cli.arguments import positive_int
from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.dataset import TASK_KEY, load_samples, sample_view

CONTENT_CHARS = 200


def _prompt_lengths(tokenizer_path: str, samples: list[Any]) -> list[int | None]:
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from transformers import AutoTokenizer

    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from opd_trainer.chat import prompt_token_ids

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        problem = f"cannot load a tokenizer from {tokenizer_path}: {exc}"
        raise ConfigError(problem, field="tokenizer") from None
    return [len(prompt_token_ids(tokenizer, s.messages, s.tools)) if s.messages else None for s in samples]


def _text(view: dict[str, Any], prompt_tokens: int | None) -> str:
    lines = [f"== {view['sample_id']} ({view['source']})"]
    if not view["messages"]:
        task = json.dumps(view["rollout_extra"].get(TASK_KEY), ensure_ascii=False)
        lines.append(f"  task: {task if len(task) <= CONTENT_CHARS else task[:CONTENT_CHARS] + '...'}")
    for message in view["messages"]:
        content = message.get("content")
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        if message.get("tool_calls"):
            names = [call.get("function", {}).get("name") for call in message["tool_calls"]]
            text = f"{text or ''} [tool_calls: {', '.join(map(str, names))}]".strip()
        short = text if len(text) <= CONTENT_CHARS else text[:CONTENT_CHARS] + "..."
        lines.append(f"  {message['role']:>9}: {short}")
    if view["tools"]:
        lines.append(f"  tools: {', '.join(map(str, view['tools']))}")
    lines.append(f"  ground_truth: {json.dumps(view['ground_truth'], ensure_ascii=False)}")
    extra = sorted(k for k in view["rollout_extra"] if k not in {"ground_truth", "solution"})
    if extra:
        lines.append(f"  rollout_extra keys: {', '.join(extra)}")
    if prompt_tokens is not None:
        lines.append(f"  prompt tokens: {prompt_tokens}")
    return "\n".join(lines)


def _preview(args: argparse.Namespace) -> int:
    try:
        samples = load_samples([args.file], "file")
        lengths = _prompt_lengths(args.tokenizer, samples) if args.tokenizer else None
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shown = samples[: args.n]
    views = [sample_view(s) for s in shown]
    if args.output == "json":
        for index, view in enumerate(views):
            if lengths is not None:
                view["prompt_tokens"] = lengths[index]
        print(json.dumps(views, indent=2, ensure_ascii=False))
        return 0
    for index, view in enumerate(views):
        print(_text(view, lengths[index] if lengths is not None else None))
    summary = f"{len(samples)} samples, all valid"
    counted = [length for length in lengths or [] if length is not None]
    if counted:
        summary += f"; prompt tokens max {max(counted)}, mean {sum(counted) / len(counted):.0f}"
    print(summary)
    return 0


def add_preview_command(commands: Any) -> None:
    preview = commands.add_parser(
        "preview", help="show how the trainer reads a dataset (JSONL) before submitting it"
    )
    preview.add_argument("file", help="a training or validation dataset, JSONL")
    preview.add_argument("-n", type=positive_int, default=2, help="samples to show (default 2)")
    preview.add_argument(
        "--tokenizer",
        help="the student's folder or Hugging Face id: count each prompt's tokens with its chat template",
    )
    preview.add_argument(
        "-o", "--output", choices=("text", "json"), default="text", help="text (default) or JSON"
    )
    preview.set_defaults(handler=_preview)
