"""Where `model` / `teacher_model` come from: a local folder, or a Hugging Face id such as
`Qwen/Qwen2.5-0.5B-Instruct` (optionally `@REVISION`) resolved through the standard hub cache
(`HF_HUB_CACHE` / `HF_HOME`) by `huggingface_hub.snapshot_download`, the loading code transformers
and vLLM use themselves.

The job then runs on the snapshot folder: engines, learner and pre-flight read one path, and a job
that resumes later reads the same revision. `opd train` may download (it is the user's machine); the
job server resolves only what its cache already holds, so a tenant cannot make it fetch anything.

A hub id comes from a tenant, and the cache lookup joins its parts into paths (`refs/<revision>`,
`snapshots/<commit>`), so both are checked before and after the lookup:

- the repository is `org/name` and the revision a branch, tag or commit name, each in letters, digits,
  `.`, `_` and `-` only, not starting with `.` and without `..`: no `/`, so no absolute path and no
  way out of the cache entry through the revision (Hub branch names with `/`, such as `refs/pr/1`,
  are given by their commit hash instead);
- the snapshot folder found, with every link resolved, lies under the hub cache folder: a ref file
  whose content leads elsewhere (`snapshots/../../..`) is refused.

The errors name the field and the id as given, never a server path, and read the same whether or
not the path a crafted id would have reached exists.
"""

from __future__ import annotations

import re
from pathlib import Path

from opd_trainer.errors import ConfigError

# `org/name` or `org/name@revision`; a local path is absolute or starts with `.`, `~` or `/`. Any
# revision matches here, so that an unsafe one is refused as a revision rather than read as a path.
_REPO = r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*"
HUB_ID = re.compile(rf"(?P<repo>{_REPO})(?:@(?P<revision>[^@]*))?")
# A revision: a 40-hex commit or a branch / tag name; `..` is refused separately.
REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def is_hub_id(value: str) -> bool:
    """Whether `value` names a Hugging Face repository rather than a folder (an existing folder wins).

    An id with a revision of unsafe characters still counts as a hub id, so `hub_snapshot` refuses it
    with a message saying what a revision may hold (instead of it being taken for a path)."""
    return HUB_ID.fullmatch(value) is not None and not Path(value).exists()


def _check_id(value: str, field: str) -> tuple[str, str | None]:
    """The repository and revision of hub id `value`, each in the safe characters."""
    match = HUB_ID.fullmatch(value)
    if match is None or ".." in match["repo"]:
        raise ConfigError(
            f"{value!r} is not a Hugging Face id (org/name[@revision], in letters, digits, '.', '_', '-')",
            field=field,
        )
    revision = match["revision"]
    if revision is not None and (REVISION.fullmatch(revision) is None or ".." in revision):
        raise ConfigError(
            f"the revision of Hugging Face id {match['repo']} is not a commit hash, branch or tag name: "
            "use letters, digits, '.', '_' and '-' only (no '/', no '..', not starting with '.'); "
            "name a branch with '/' by its commit hash",
            field=field,
        )
    return match["repo"], revision


def hub_snapshot(value: str, field: str, *, download: bool) -> Path:
    """The local snapshot folder of hub id `value`; downloads it first when `download` is true."""
    # Lazy: transformers/huggingface_hub load only when a model is read, not with the spec.
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, revision = _check_id(value, field)
    cache = Path(constants.HF_HUB_CACHE)
    not_cached = ConfigError(
        f"{value} is not in the server's Hugging Face cache: the operator downloads it there "
        f"(`hf download {repo}` with the server's HF_HOME), or the job names "
        "an approved model folder instead",
        field=field,
    )
    try:
        folder = snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=not download)
    except LocalEntryNotFoundError:
        if download:
            raise ConfigError(
                f"{value} is not a local model folder, and as a Hugging Face id it could not be "
                "downloaded (no network, or HF_HUB_OFFLINE is set)",
                field=field,
            ) from None
        raise not_cached from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        if not download:
            # The server's cache lookup: its exception may quote cache paths; the tenant learns only
            # that the id is not there to use.
            raise not_cached from None
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"{value} is not a local model folder, and as a Hugging Face id: {first_line}", field=field
        ) from None
    # resolve() follows links: a ref whose content names a folder outside the cache ends up outside.
    if not Path(folder).resolve().is_relative_to(cache.resolve()):
        raise not_cached
    return Path(folder)


def local_model(value: str, field: str, *, download: bool) -> str:
    """`value` as a local model folder: a hub id becomes its snapshot folder, a path stays as it is."""
    return str(hub_snapshot(value, field, download=download)) if is_hub_id(value) else value
