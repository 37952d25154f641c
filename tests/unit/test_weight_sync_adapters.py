"""`weight_sync/adapters.py`: a PEFT adapter folder's files, exported and materialized on an engine's node.

Ray's object store is stubbed (`ray.put` hands back an awaitable, as an ObjectRef is), as in
`test_weight_transfer.py`; the handoff is pickled on the way, as Ray would.
"""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from typing import Any

import pytest

from opd_trainer.weight_sync import AdapterHandoff, AdapterTransfer, adapters

FILES = {"adapter_config.json": b'{"r": 8, "lora_alpha": 16}', "adapter_model.safetensors": b"\x00" * 40}


class _Ref:
    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Any:
        yield from asyncio.sleep(0).__await__()
        return self.value


def test_export_then_materialize_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapters.ray, "put", _Ref)
    transfer = AdapterTransfer()
    handoff = transfer.export(FILES, version=3)
    assert isinstance(handoff, AdapterHandoff) and handoff.kind == "adapter"
    assert handoff.version == 3 and handoff.num_bytes == sum(len(v) for v in FILES.values())
    handoff = pickle.loads(pickle.dumps(handoff))

    folder = asyncio.run(transfer.materialize(handoff, tmp_path / "adapters"))
    assert folder == tmp_path / "adapters" / "v3"
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == FILES
    assert asyncio.run(transfer.materialize(handoff, tmp_path / "adapters")) == folder  # idempotent
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["v3"]  # no partial folder left
    transfer.release(handoff)


def test_export_refuses_paths_and_missing_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapters.ray, "put", _Ref)
    with pytest.raises(ValueError, match="bare file name"):
        AdapterTransfer().export({**FILES, "../evil": b""}, 1)
    with pytest.raises(ValueError, match="missing"):
        AdapterTransfer().export({"adapter_config.json": b"{}"}, 1)
