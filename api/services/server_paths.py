"""No server path in an answer: what the tenant sees of the server's disk is ids and names it gave.

The engine's code runs on server paths (pre-flight, the job driver, the scheduler) and says them in
its messages, which is what `opd train` on one's own machine should do. Everything a tenant reads of a
job (its error, its events and logs, its checkpoints, a refused submission) goes through here first:

- a job's run folder becomes the job's id: `DATA/runs/opdjob-…/checkpoints/step-000004` reads
  `opdjob-…/checkpoints/step-000004`, which is also how a new job's `model` names a checkpoint's
  student (`CHECKPOINT_MODEL`);
- an upload and its extracted folder become the file's id (`DATA/workspaces/file-…/x.py` → `file-…/x.py`);
- anything else under the data directory becomes `<server path>`, the Hugging Face cache `<hub cache>`.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import constants

from opd_trainer.wire.schemas import EventPublic

if TYPE_CHECKING:
    from api.models import Job, JobEvent

# A checkpoint's student as a job's `model` names it: `<job id>/checkpoints/<checkpoint id>/student`,
# the `student` of `GET /v1/opd/jobs/{job_id}/checkpoints`.
CHECKPOINT_MODEL = re.compile(r"(?P<job>opdjob-[0-9a-f]+)/(?P<folder>checkpoints/step-[0-9]+/student)")

# Where a path in a message ends: whitespace, quotes, brackets and separators a message wraps it in.
_PATH_TAIL = r"(?:/[^\s'\"<>()\[\]{},;]*)?(?![A-Za-z0-9_.-])"
# The data directory's folders named by an id: a job's run (`api.services.jobs.create`) and an upload,
# its extracted workspace or model (`api.services.files`).
_ID_FOLDERS = r"/(?:runs|files|workspaces|uploaded-models)/(?P<id>[A-Za-z0-9_-]+)(?![A-Za-z0-9_.-])"


def data_dir_of(job: Job) -> Path:
    """The server's data directory, from which `create` made the job's run folder (`DATA/runs/ID`)."""
    return Path(job.run_dir).parent.parent


def run_name(job: Job, path: str | Path) -> str:
    """A path inside the job's run folder as the tenant names it: `<job id>/<path in the run>`."""
    return f"{job.id}/{Path(path).relative_to(job.run_dir).as_posix()}"


@functools.lru_cache(maxsize=16)
def _substitutions(data_dir: str, hub_cache: str) -> list[tuple[re.Pattern[str], str]]:
    """The patterns `public_text` applies, longest root first, each root as given and resolved (a
    message may hold either); built once per data dir, since a page of events applies them often."""
    found = []
    for root in sorted({data_dir, str(Path(data_dir).resolve())}, key=len, reverse=True):
        found.append((re.compile(re.escape(root) + _ID_FOLDERS), r"\g<id>"))
        found.append((re.compile(re.escape(root) + _PATH_TAIL), "<server path>"))
    for root in sorted({hub_cache, str(Path(hub_cache).resolve())}, key=len, reverse=True):
        found.append((re.compile(re.escape(root) + r"(?![A-Za-z0-9_.-])"), "<hub cache>"))
    return found


def public_text(text: str, data_dir: Path) -> str:
    """`text` with every path under `data_dir` or the hub cache named as the module docstring says."""
    if "/" not in text:
        return text
    for pattern, replacement in _substitutions(str(data_dir), str(constants.HF_HUB_CACHE)):
        text = pattern.sub(replacement, text)
    return text


def public_value(value: Any, data_dir: Path) -> Any:
    """`value` (an event's `data`) with `public_text` applied to every string in it."""
    if isinstance(value, str):
        return public_text(value, data_dir)
    if isinstance(value, dict):
        return {k: public_value(v, data_dir) for k, v in value.items()}
    if isinstance(value, list):
        return [public_value(v, data_dir) for v in value]
    return value


def public_event(event: JobEvent | EventPublic, data_dir: Path) -> EventPublic:
    """The event as the tenant reads it: its message and data without server paths."""
    found = EventPublic.model_validate(event)
    return found.model_copy(
        update={"message": public_text(found.message, data_dir), "data": public_value(found.data, data_dir)}
    )
