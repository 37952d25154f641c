"""A word-level tokenizer with a ChatML-like chat template, saved and loaded as a model's would be: what
the unit tests of prompt rendering (hindsight notes, beacons) render with instead of a model's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "tool", "what", "is", "5"]
WORDS += ["2", "3", "+", ":", "a", "correct", "final", "answer", "to", "this", "task", "be", "brief"]


def save_chatml_tokenizer(
    folder: Path,
    template: str = TEMPLATE,
    words: list[str] = WORDS,
    special: tuple[str, ...] = ("<|im_start|>", "<|im_end|>"),
) -> Path:
    """A word-level tokenizer of `words` (unknown ones: [UNK]) with `special` tokens and the chat
    `template`, saved as a model's in `folder`; returns `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", additional_special_tokens=list(special)
    )
    fast.chat_template = template
    fast.save_pretrained(str(folder))
    return folder


def chatml_tokenizer(folder: Path, template: str = TEMPLATE) -> Any:
    """`save_chatml_tokenizer`'s default tokenizer (or another `template`), loaded back with
    `AutoTokenizer` as a model's would be."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(save_chatml_tokenizer(folder, template)))
