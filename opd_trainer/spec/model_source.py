"""Where `model` / `teacher_model` come from: a local folder, or a Hugging Face id such as
`Qwen/Qwen2.5-0.5B-Instruct` (optionally `@REVISION`) resolved through the standard hub cache
(`HF_HUB_CACHE` / `HF_HOME`) by `huggingface_hub.snapshot_download`, the loading code transformers
and vLLM use themselves.

The job then runs on the snapshot folder: engines, learner and pre-flight read one path, and a job
that resumes later reads the same revision. `opd train` may download (it is the user's machine); the
job server resolves only what its cache already holds, so a tenant cannot make it fetch anything.
"""

from __future__ import annotations

import re
from pathlib import Path

from opd_trainer.errors import ConfigError

# `org/name` or `org/name@revision`; a local path is absolute or starts with `.`, `~` or `/`.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")


def is_hub_id(value: str) -> bool:
    """Whether `value` names a Hugging Face repository rather than a folder (an existing folder wins)."""
    return HUB_ID.match(value) is not None and not Path(value).exists()


def hub_snapshot(value: str, field: str, *, download: bool) -> Path:
    """The local snapshot folder of hub id `value`; downloads it first when `download` is true."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    match = HUB_ID.match(value)
    if match is None:
        raise ConfigError(f"{value!r} is not a Hugging Face id (org/name[@revision])", field=field)
    try:
        folder = snapshot_download(match["repo"], revision=match["revision"], local_files_only=not download)
    except LocalEntryNotFoundError:
        if download:
            raise ConfigError(
                f"{value} is not a local model folder, and as a Hugging Face id it could not be "
                "downloaded (no network, or HF_HUB_OFFLINE is set)",
                field=field,
            ) from None
        raise ConfigError(
            f"{value} is not in the server's Hugging Face cache: the operator downloads it there "
            f"(`hf download {match['repo']}` with the server's HF_HOME), or the job names "
            "an approved model folder instead",
            field=field,
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"{value} is not a local model folder, and as a Hugging Face id: {first_line}", field=field
        ) from None
    return Path(folder)


def local_model(value: str, field: str, *, download: bool) -> str:
    """`value` as a local model folder: a hub id becomes its snapshot folder, a path stays as it is."""
    return str(hub_snapshot(value, field, download=download)) if is_hub_id(value) else value
