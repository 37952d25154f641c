"""What pre-flight may read from a model folder inside the API process: bounded in size, and never code.

The job server loads the student's and teacher's tokenizers at submission (`check_same_tokenizer`)
in its own process, from folders a tenant can fill (an uploaded model, a checkpoint of its own job).
transformers runs a folder's own Python (`auto_map` in `tokenizer_config.json` or `config.json`) only
with `trust_remote_code`, which nothing in this project sets; a folder that asks for custom code is
refused here, before transformers opens it, whatever transformers' default does with such a folder.
The files pre-flight parses (config.json and the tokenizer's files) are bounded in total by
`OPD_MODEL_MAX_TOKENIZER_BYTES`, so loading them costs bounded time and memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from opd_trainer.errors import ConfigError

# Files of a Hugging Face folder that a tokenizer load (and the context-length check) may read.
TOKENIZER_FILE_PREFIXES = (
    "config.json",
    "tokenizer",
    "vocab",
    "merges",
    "special_tokens_map",
    "added_tokens",
    "chat_template",
    "spiece",
    "sentencepiece",
)
TOKENIZER_FILE_SUFFIXES = (".model", ".tiktoken", ".jinja")
# Where transformers looks for custom classes (its `auto_map`).
CODE_CONFIGS = ("config.json", "tokenizer_config.json")


def tokenizer_files(folder: Path) -> list[Path]:
    return sorted(
        entry
        for entry in folder.iterdir()
        if entry.is_file()
        and (entry.name.startswith(TOKENIZER_FILE_PREFIXES) or entry.name.endswith(TOKENIZER_FILE_SUFFIXES))
    )


def check_model_folder(folder: Path, field: str, max_bytes: int) -> None:
    """Raises `ConfigError(field=field)` if pre-flight's files in `folder` exceed `max_bytes` together
    or a config asks for custom code; messages name files by their name only, never a server path."""
    files = tokenizer_files(folder)
    total = sum(path.stat().st_size for path in files)
    if total > max_bytes:
        raise ConfigError(
            f"the model's config and tokenizer files take {total} bytes; the server reads at most "
            f"{max_bytes} (OPD_MODEL_MAX_TOKENIZER_BYTES)",
            field=field,
        )
    for name in CODE_CONFIGS:
        config = _json_object(folder / name)
        if "auto_map" in config:
            raise ConfigError(
                f"the model's {name} names custom code (`auto_map`); the server never runs a model's own "
                "Python: use a model whose architecture and tokenizer transformers ships",
                field=field,
            )


def _json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return {}  # not a config transformers could read either; its own load reports it
    return found if isinstance(found, dict) else {}


def check_models(sources: dict[str, str], max_bytes: int) -> None:
    """`check_model_folder` on the resolved student and teacher folders (`JobSpec.weight_sources`; a
    missing one is left to pre-flight, which says so)."""
    for field, value in sources.items():
        if Path(value).is_dir():
            check_model_folder(Path(value), field, max_bytes)
