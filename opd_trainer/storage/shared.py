"""Checks that a job's run directory is the same folder for the server, its driver and its learner.

Storage is shared on purpose, not moved through the driver: the server hands the driver paths in its
data dir (datasets, workspaces, the run dir) and reads the run dir back (metrics, checkpoints, the
trained model), and every learner rank writes its own DeepSpeed shard of a checkpoint. Moving
checkpoints through Ray would hold a whole model in the object store per save, so every node mounts
the data dir at the same path instead (the Helm chart's ReadWriteMany volume). When that is not so, a
job would fail on a missing dataset file, or its checkpoints would land on a disk the server never
sees; this probe says which node cannot see the folder and what to mount.

The server (or `opd train`) writes `storage-probe.json` with a fresh token into the run dir before
it starts the driver; the driver and each learner rank read it back.
"""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path

from opd_trainer.errors import ConfigError

PROBE_FILE = "storage-probe.json"
SHARED_STORAGE_HINT = (
    "every Ray node must mount the server's data dir (OPD_DATA_DIR) at the same path: with the Helm "
    "chart, a ReadWriteMany `persistence` volume and `ray.common.mountDataVolume: true`; elsewhere, one "
    "shared filesystem mounted at that path on the server and every Ray node"
)


def write_probe(run_dir: Path) -> str:
    """Writes a new token into `run_dir` (created if needed) and returns it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    (run_dir / PROBE_FILE).write_text(json.dumps({"token": token, "host": socket.gethostname()}))
    return token


def check_probe(run_dir: Path, token: str, reader: str) -> None:
    """Raises a ConfigError naming `reader` and its host unless `run_dir` holds the token just written."""
    path = run_dir / PROBE_FILE
    try:
        written = json.loads(path.read_text())
    except (OSError, ValueError):
        written = None
    if isinstance(written, dict) and written.get("token") == token:
        return
    seen = "an older probe" if isinstance(written, dict) else "no probe"
    writer = f" written on {written.get('host')}" if isinstance(written, dict) else ""
    raise ConfigError(
        f"the {reader} on host {socket.gethostname()} does not see the job's run directory {run_dir} "
        f"(found {seen}{writer}): {SHARED_STORAGE_HINT}",
        field="run_dir",
    )
