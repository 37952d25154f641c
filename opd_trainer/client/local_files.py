"""What both clients do on the local disk, defined once: the file an upload sends (a folder is zipped
first), a job spec's local files and the spec with file ids in their place, Bailian's `run(...)`
arguments as a spec, and a downloaded checkpoint unpacked into a model folder.

The server reads only what was uploaded to it, so a spec's local dataset files and `fcmodel.zipdir`
folders are uploaded and replaced by their file ids before it is submitted.
"""

from __future__ import annotations

import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Required, TypedDict

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.job_spec import JobSpec, parse_job_spec, resolve_paths
from opd_trainer.storage.zip_stream import stream_zip
from opd_trainer.storage.zips import check_zip, extract_zip, pack_workspace
from opd_trainer.wire.schemas import FilePurpose, JobPublic

DOWNLOAD_CHUNK = 1024 * 1024
# What a downloaded checkpoint may expand to: a model folder (weights are stored, not compressed).
MODEL_MAX_FILES = 10_000
MODEL_MAX_BYTES = 4 * 1024**4
MODEL_MAX_RATIO = 1000.0

# A local file to upload, once per spec: its resolved path and the purpose it is uploaded for.
Upload = tuple[str, FilePurpose]


class RunArguments(TypedDict, total=False):
    """The arguments of Bailian's `AgenticRL().run(...)`, which `run` takes by keyword.

    Datasets are local paths (uploaded), file ids, or Bailian's `{data_source_type, file_name}`.
    """

    job_name: Required[str]
    model: Required[str]
    teacher_model: Required[str | list[dict[str, Any]]]
    training_datasets: Required[list[str | dict[str, Any]]]
    validation_datasets: list[str | dict[str, Any]] | None
    functions: list[dict[str, Any]] | None
    hyper_parameters: dict[str, Any] | None
    resources: dict[str, Any] | None


def run_spec(arguments: RunArguments) -> dict[str, Any]:
    """The job document of `run(...)`'s arguments (absent lists and mappings are empty)."""
    spec: dict[str, Any] = {"validation_datasets": [], "functions": [], "hyper_parameters": {}}
    spec.update({name: value for name, value in arguments.items() if value is not None})
    return spec


def parse_spec(spec: JobSpec | dict[str, Any], base_dir: str | Path) -> JobSpec:
    """The spec validated here, before anything is sent, with its local paths relative to `base_dir`."""
    parsed = spec if isinstance(spec, JobSpec) else parse_job_spec(spec)
    return resolve_paths(parsed, Path(base_dir))


def spec_with_file_ids(spec: JobSpec, file_id: Callable[[Upload], str]) -> dict[str, Any]:
    """The spec as the server takes it: each local dataset file and `fcmodel.zipdir` replaced by
    `file_id(upload)`; a dataset that is already a file id stays. A path that is neither raises."""

    def dataset(value: str, field: str) -> str:
        if Path(value).is_file():
            return file_id((str(Path(value).resolve()), "dataset"))
        if value.startswith("file-"):
            return value  # already uploaded
        raise ConfigError(f"{value} is neither a local file nor a file id", field=field)

    data = spec.model_dump(mode="json", exclude_none=True)
    for name in ("training_datasets", "validation_datasets"):
        data[name] = [dataset(d, f"{name}.{i}") for i, d in enumerate(getattr(spec, name))]
    for entry, component in zip(data["functions"], spec.functions, strict=True):
        zipdir = component.fcmodel.zipdir
        if zipdir is None:
            continue
        if not Path(zipdir).exists():
            raise ConfigError(f"{zipdir} does not exist", field=f"functions.{component.name}.fcmodel.zipdir")
        entry["fcmodel"] = {
            "workspace": file_id((str(Path(zipdir).resolve()), "workspace")),
            "classpath": component.fcmodel.classpath,
        }
    return data


def uploads(spec: JobSpec) -> list[Upload]:
    """The spec's local files to upload, each once, in the order the spec names them."""
    found: list[Upload] = []

    def record(upload: Upload) -> str:
        if upload not in found:
            found.append(upload)
        return ""

    spec_with_file_ids(spec, record)
    return found


@contextmanager
def upload_source(path: str | Path, purpose: FilePurpose) -> Iterator[tuple[str, bytes | IO[bytes]]]:
    """The file name and content an upload of `path` sends: the file, or a folder zipped (a workspace
    in memory; a model, which may be large, stored to a temporary file)."""
    path = Path(path)
    if purpose == "workspace" and path.is_dir():
        yield f"{path.resolve().name or 'workspace'}.zip", pack_workspace(path)
        return
    if purpose == "model" and path.is_dir():
        with tempfile.TemporaryDirectory(prefix="opd-model-upload-") as scratch:
            name = path.resolve().name or "model"
            archive = Path(scratch) / f"{name}.zip"
            with archive.open("wb") as sink:
                for chunk in stream_zip(path, name):
                    sink.write(chunk)
            with archive.open("rb") as handle:
                yield archive.name, handle
        return
    with path.open("rb") as handle:
        yield path.name, handle


def fine_tuned_model(job: JobPublic) -> str:
    """The checkpoint a download takes by default: the job's `fine_tuned_model`."""
    if not job.fine_tuned_model:
        raise ConfigError(
            f"job {job.id} has no fine_tuned_model ({job.status}); name a checkpoint "
            "from its checkpoint list",
            field="checkpoint_id",
        )
    return job.fine_tuned_model


def download_target(job_id: str, checkpoint_id: str, target: str | Path | None) -> Path:
    """Where a checkpoint is unpacked (default `./JOB_ID-CHECKPOINT_ID`); it must not exist yet."""
    destination = Path(target) if target is not None else Path(f"{job_id}-{checkpoint_id}")
    if destination.exists():
        raise ConfigError(f"{destination} already exists", field="target")
    destination.parent.mkdir(parents=True, exist_ok=True)
    return destination


@contextmanager
def download_scratch(destination: Path) -> Iterator[Path]:
    """A path for the downloaded zip, in a scratch folder beside `destination` (so that the unpacked
    folder is moved into place, not copied) that is removed afterwards."""
    with tempfile.TemporaryDirectory(dir=destination.parent, prefix=".download-") as scratch:
        yield Path(scratch) / "checkpoint.zip"


def unpack_checkpoint(archive_path: Path, destination: Path) -> Path:
    """Checks the downloaded zip (size, file count, paths) and moves its one top folder, a Hugging
    Face model folder, to `destination`."""
    unpacked = archive_path.parent / "model"
    with zipfile.ZipFile(archive_path) as archive:
        infos = check_zip(
            archive,
            max_files=MODEL_MAX_FILES,
            max_uncompressed=MODEL_MAX_BYTES,
            max_ratio=MODEL_MAX_RATIO,
            field="checkpoint",
        )
        extract_zip(archive, infos, unpacked, field="checkpoint")
    [top] = list(unpacked.iterdir())
    top.rename(destination)
    return destination
