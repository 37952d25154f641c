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


def chatml_tokenizer(folder: Path, template: str = TEMPLATE) -> Any:
    """The tokenizer, saved to `folder` and loaded back with `AutoTokenizer` (unknown words: [UNK])."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = template
    fast.save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))
