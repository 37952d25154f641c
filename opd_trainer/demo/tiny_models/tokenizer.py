"""Byte-level BPE tokenizer and ChatML rendering for the tiny teacher/student models.

The tokenizer mirrors Qwen2.5's layout so vLLM treats the tiny models like a Qwen2.5 checkpoint:
a Qwen2-like pre-tokenizer (see `PRETOKENIZE_REGEX` for the one difference), ChatML special tokens,
and `<tool_call>`/`<tool_response>` markers that are added tokens but not special ones, so they survive
`skip_special_tokens=True` decoding and vLLM's `hermes` tool parser finds them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)
TOOL_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
DEFAULT_VOCAB_SIZE = 1536

# Qwen2's pre-tokenizer pattern (digits one by one) except that letters never absorb the character before
# them: Qwen2 turns " low" (prose) and "\"low" (JSON) into different tokens, here both hold the token "low",
# so a value copied from the user turn into tool-call arguments is a plain token-for-token copy.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

Message = Mapping[str, Any]


@cache
def chat_template() -> str:
    """The Jinja chat template shipped as package data (`chat_template.jinja`)."""
    return resources.files(__package__).joinpath("chat_template.jinja").read_text(encoding="utf-8")


@cache
def _compiled_template() -> jinja2.Template:
    # Same environment transformers uses for apply_chat_template, so the corpus the BPE is trained on and
    # the prompts the models see at run time are rendered identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    return env.from_string(chat_template())


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' `tojson` filter: unlike Jinja's own, it keeps non-ASCII text and does not HTML-escape.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render_chat(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """Render OpenAI-format messages with the tiny models' chat template, without needing a tokenizer."""
    return _compiled_template().render(
        messages=list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a deterministic byte-level BPE on rendered conversations.

    Ids 0-2 are the special tokens, 3-6 the tool markers; the byte alphabet and merges follow.
    """
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[*SPECIAL_TOKENS, *TOOL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # The trainer does not cut added tokens out of its input, so we do: at encode time markers are
    # matched before pre-tokenization, and training on the pieces between them learns exactly those merges.
    tokenizer.train_from_iterator(_between_markers(texts), trainer=trainer)
    # The trainer registers every token it was given as special; the tool markers must not be, so that
    # `skip_special_tokens=True` keeps them (as Qwen2.5 does), hence the edit of the serialized form.
    state = json.loads(tokenizer.to_str())
    for added in state["added_tokens"]:
        added["special"] = added["content"] in SPECIAL_TOKENS
    return Tokenizer.from_str(json.dumps(state))


_MARKER_RE = re.compile("|".join(re.escape(t) for t in (*SPECIAL_TOKENS, *TOOL_TOKENS)))


def _between_markers(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        yield from (part for part in _MARKER_RE.split(text) if part)


def wrap_tokenizer(tokenizer: Tokenizer, model_max_length: int = 1024) -> PreTrainedTokenizerBase:
    """Wrap a trained `tokenizers.Tokenizer` as a transformers fast tokenizer carrying the chat template.

    Padding stays on the right (the transformers default, as for Qwen2.5); batched `generate` callers set
    `padding_side = "left"` themselves.
    """
    # Lazy: transformers loads only when a tokenizer is wrapped.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        model_max_length=model_max_length,
        chat_template=chat_template(),
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int = 1024) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja loadable by AutoTokenizer/vLLM."""
    wrap_tokenizer(tokenizer, model_max_length).save_pretrained(str(out_dir))
