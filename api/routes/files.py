"""Files: upload (multipart, purpose `dataset`, `workspace` or `model`), list, get, delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Query, UploadFile, status

from api.deps import SessionDep, SettingsDep, TenantDep
from api.errors import TENANT, errors
from api.services import files
from opd_trainer.wire.schemas import Deleted, FileList, FilePublic, FilePurpose

router = APIRouter(prefix="/v1/files", tags=["files"])


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=FilePublic,
    responses=errors(400, *TENANT, 413, 422),
)
def upload_file(
    file: Annotated[UploadFile, File(description="A JSONL dataset, a zipped workspace or a zipped model.")],
    purpose: Annotated[
        FilePurpose,
        Form(description="`dataset` (JSONL), `workspace` (zip) or `model` (zipped Hugging Face folder)."),
    ],
    session: SessionDep,
    settings: SettingsDep,
    tenant: TenantDep,
) -> FilePublic:
    return files.upload(session, settings, tenant.id, file.file, file.filename, purpose)


@router.get("", response_model=FileList, responses=errors(*TENANT, 422))
def list_files(
    session: SessionDep, tenant: TenantDep, purpose: Annotated[FilePurpose | None, Query()] = None
) -> FileList:
    return FileList(data=files.list_files(session, tenant.id, purpose))


@router.get("/{file_id}", response_model=FilePublic, responses=errors(*TENANT, 404))
def get_file(file_id: str, session: SessionDep, tenant: TenantDep) -> FilePublic:
    return files.get(session, tenant.id, file_id)


@router.delete("/{file_id}", response_model=Deleted, responses=errors(*TENANT, 404, 409))
def delete_file(file_id: str, session: SessionDep, tenant: TenantDep) -> Deleted:
    files.delete(session, tenant.id, file_id)
    return Deleted(id=file_id, object="file")
