"""Uploaded files: datasets validated line by line, workspace and model zips checked before anything
is extracted (a model must hold one Hugging Face folder: `config.json` at its top or one folder down).

A dataset is parsed with the engine's own `parse_jsonl`, so the server and `opd train` accept exactly
the same records. A workspace zip is rejected, before a byte is extracted, for too many entries,
absolute paths, `..`, links or other non-regular entries, encryption, a total uncompressed size over
the limit, or an entry whose compression ratio says "zip bomb"; it is then extracted into a fresh
folder under the data dir, each target checked to stay inside it.
"""

from __future__ import annotations

import re
import shutil
import zipfile
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.errors import APIError, not_found
from api.models import File, Job
from api.schemas import FilePublic
from api.services.ids import new_id
from api.services.states import TERMINAL
from api.settings import Settings
from opd_trainer.errors import ConfigError
from opd_trainer.spec.dataset import parse_jsonl
from opd_trainer.workers.workspace import COPY_CHUNK, check_zip, extract_zip


def safe_filename(name: str | None) -> str:
    base = Path((name or "").replace("\\", "/")).name
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", base)[:128].lstrip(".")
    return cleaned or "upload"


def _public(record: File) -> FilePublic:
    return FilePublic.model_validate(record)


def upload(
    session: Session, settings: Settings, tenant_id: str, source: BinaryIO, filename: str | None, purpose: str
) -> FilePublic:
    file_id = new_id("file")
    folder = settings.files_dir / file_id
    folder.mkdir(parents=True)
    path = folder / safe_filename(filename)
    try:
        with path.open("wb") as sink:
            shutil.copyfileobj(source, sink, COPY_CHUNK)
        size = path.stat().st_size
        if size > settings.max_upload_bytes:
            raise APIError(413, "file_too_large", f"upload exceeds {settings.max_upload_bytes} bytes", "file")
        record = File(
            id=file_id, tenant_id=tenant_id, filename=path.name, purpose=purpose, bytes=size, path=str(path)
        )
        if purpose == "dataset":
            record.samples = _validate_dataset(path)
        elif purpose == "model":
            record.extracted_dir = str(_extract_model(settings, path, file_id))
        else:
            record.extracted_dir = str(_extract_workspace(settings, path, file_id))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    session.add(record)
    session.commit()
    return _public(record)


def _validate_dataset(path: Path) -> int:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path.name}: not UTF-8 text (byte {exc.start})", field="file") from None
    try:
        return len(parse_jsonl(text, path.name))
    except ConfigError as exc:
        raise ConfigError(exc.message, field="file") from None


def _extract(
    path: Path, target: Path, what: str, max_files: int, max_uncompressed: int, max_ratio: float
) -> None:
    """Checks the zip at `path` (`check_zip`) and extracts it into the new folder `target`."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        raise ConfigError(f"{path.name}: a {what} must be a zip archive", field="file") from None
    with archive:
        infos = check_zip(
            archive, max_files=max_files, max_uncompressed=max_uncompressed, max_ratio=max_ratio
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        extract_zip(archive, infos, target)


def _extract_workspace(settings: Settings, path: Path, file_id: str) -> Path:
    target = settings.workspaces_dir / file_id
    _extract(
        path,
        target,
        "workspace",
        settings.workspace_max_files,
        settings.workspace_max_uncompressed_bytes,
        settings.workspace_max_compression_ratio,
    )
    return target


def _extract_model(settings: Settings, path: Path, file_id: str) -> Path:
    """A zipped Hugging Face model folder (its files at the top, or under one folder), checked like a
    workspace with the model limits, extracted; returns the folder holding `config.json`."""
    target = settings.uploaded_models_dir / file_id
    _extract(
        path,
        target,
        "model",
        settings.model_max_files,
        settings.model_max_uncompressed_bytes,
        settings.workspace_max_compression_ratio,
    )
    configs = sorted(target.glob("config.json")) or sorted(target.glob("*/config.json"))
    if len(configs) != 1:
        shutil.rmtree(target, ignore_errors=True)
        found = "no config.json" if not configs else "several model folders"
        raise ConfigError(
            f"{path.name}: not a Hugging Face model folder ({found} at its top or one folder down)",
            field="file",
        )
    return configs[0].parent


def get_owned(session: Session, tenant_id: str, file_id: str, param: str | None = None) -> File:
    record = session.get(File, file_id)
    if record is None or record.tenant_id != tenant_id:
        raise not_found("file", file_id, param)
    return record


def get(session: Session, tenant_id: str, file_id: str) -> FilePublic:
    return _public(get_owned(session, tenant_id, file_id, "file_id"))


def list_files(session: Session, tenant_id: str, purpose: str | None) -> list[FilePublic]:
    query = select(File).where(File.tenant_id == tenant_id).order_by(File.created_at.desc(), File.id)
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    return [_public(f) for f in session.scalars(query)]


def delete(session: Session, tenant_id: str, file_id: str) -> None:
    record = get_owned(session, tenant_id, file_id, "file_id")
    active = session.scalars(select(Job).where(Job.tenant_id == tenant_id, Job.status.not_in(TERMINAL))).all()
    users = [job.id for job in active if file_id in job.file_ids]
    if users:
        raise APIError(409, "file_in_use", f"file is used by unfinished job(s) {', '.join(users)}", "file_id")
    session.delete(record)
    session.commit()
    shutil.rmtree(Path(record.path).parent, ignore_errors=True)
    if record.extracted_dir:
        extracted = Path(record.extracted_dir)
        # An uploaded model's folder may sit one level under its file id's folder: remove that.
        root = next((p for p in (extracted, *extracted.parents) if p.name == record.id), extracted)
        shutil.rmtree(root, ignore_errors=True)
