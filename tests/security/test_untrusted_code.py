"""A hostile tenant's processor on a real server (real Ray, vLLM, DeepSpeed, bubblewrap, SQLite file).

Two tenants on one `opd serve`: the victim uploads a dataset; the attacker's rollout processor tries,
from inside its sandbox, every path the issue names to the server's secrets, data, other tenants and
the cluster, and reports each as a rollout metric (1.0 = blocked). The job must train anyway. A second
server, whose nodes cannot start bubblewrap, must refuse user code instead of running it unconfined.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil
import pytest
from apiserver import ADMIN_KEY, TINY_MODELS_DIR, Server, create_key

from opd_trainer.client import OPDClient, StreamEnd
from opd_trainer.jsonl import read_jsonl, write_jsonl
from opd_trainer.workers.sandbox import bwrap_problem

if TYPE_CHECKING:
    from opd_trainer.demo.tiny_models import TinyModels

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ENGINE = {"kv_cache_memory_bytes": 134217728, "dtype": "float32"}
VICTIM_TEXT = "victim-tenant-private-record-7f3a"
ESCAPE_MARKER = "opd-escape-marker-5b1c"
CANCEL_GRACE_S = 10

BLOCKER = """
import time

from opd_trainer.sdk import AbstractRolloutProcessor


class Blocker(AbstractRolloutProcessor):
    async def process(self, rollout_input):
        time.sleep(10**6)  # synchronous: the sandbox's event loop stops; only a kill ends it
"""

# {data_dir}, {api_port}, {ray_address} are filled in by the test; every probe returns 1.0 if blocked.
ATTACKER = """
import glob
import os
import socket
import subprocess
import sys
import time

from opd_trainer.sdk import AbstractRolloutProcessor, AgentOutput, RolloutOutput

ADMIN_KEY = {admin_key!r}
DATA_DIR = {data_dir!r}
VICTIM_TEXT = {victim_text!r}
PORTS = {ports!r}
ESCAPE_MARKER = {escape_marker!r}
FOUND = {{}}


def blocked(attempt):
    try:
        return 0.0 if attempt() else 1.0
    except Exception:
        return 1.0


def secret_in_some_environ():
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            if ADMIN_KEY.encode() in open(path, "rb").read():
                return True
        except OSError:
            pass
    return False


def data_dir_through_proc_root():
    for root in glob.glob("/proc/[0-9]*/root"):
        try:
            if os.listdir(root + DATA_DIR):
                return True
        except OSError:
            pass
    return False


def victim_upload_readable():
    for path in glob.glob(DATA_DIR + "/**", recursive=True):
        try:
            if VICTIM_TEXT in open(path, errors="replace").read():
                return True
        except OSError:
            pass
    return os.path.exists(DATA_DIR)


def database_writable():
    with open(os.path.join(DATA_DIR, "opd.db"), "ab"):
        return True


def ray_reachable():
    import ray

    ray.init(address="auto", log_to_driver=False)
    return bool(ray.util.list_named_actors(all_namespaces=True))


def cluster_port_reachable():
    for port in PORTS:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return True
        except OSError:
            pass
    return False


def internet_reachable():
    socket.create_connection(("1.1.1.1", 443), timeout=2).close()
    return True


def weight_handoffs_visible():
    return any(name.startswith("opd-weights") for name in os.listdir("/dev/shm"))


def ray_token_readable():
    return any(os.path.exists(p) for p in ("/root/.ray/auth_token", os.path.expanduser("~/.ray/auth_token")))


def fork_bomb_unbounded():
    children = []
    try:
        for _ in range(3000):
            pid = os.fork()
            if pid == 0:  # a small process each: the process bound, not the memory bound, must hold
                os.execv("/bin/sleep", ["sleep", "5"])
            children.append(pid)
    except OSError:
        return False  # the process bound held
    finally:
        for pid in children:
            try:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            except OSError:
                pass
    return True


def rollout_records_readable(resource):
    import json
    import urllib.error
    import urllib.request

    key = resource.api_key.get_secret_value()
    for credential in ({{"Authorization": "Bearer " + key}}, {{"X-OPD-Close-Secret": key}}):
        request = urllib.request.Request(
            resource.base_url + "/rollouts/close",
            data=json.dumps({{"keys": [key]}}).encode(),
            headers={{**credential, "Content-Type": "application/json"}},
            method="POST",
        )
        try:
            if urllib.request.urlopen(request, timeout=5).status == 200:
                return True
        except urllib.error.HTTPError:
            pass
    return False


def probe():
    if not FOUND:
        FOUND.update(
            probe_admin_key_in_environ=blocked(secret_in_some_environ),
            probe_data_dir_via_proc_root=blocked(data_dir_through_proc_root),
            probe_victim_upload=blocked(victim_upload_readable),
            probe_database_write=blocked(database_writable),
            probe_ray_cluster=blocked(ray_reachable),
            probe_server_ports=blocked(cluster_port_reachable),
            probe_internet=blocked(internet_reachable),
            probe_weight_handoffs=blocked(weight_handoffs_visible),
            probe_ray_token=blocked(ray_token_readable),
            probe_fork_bomb=blocked(fork_bomb_unbounded),
        )
    return FOUND


class Attacker(AbstractRolloutProcessor):
    def setup(self):
        # A double fork: a process that would outlive its job if nothing bounded the sandbox's tree.
        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(10**6)", ESCAPE_MARKER],
            start_new_session=True,
        )

    async def process(self, rollout_input):
        resource = rollout_input.model_resource
        found = dict(probe(), probe_rollout_records=blocked(lambda: rollout_records_readable(resource)))
        client = rollout_input.model_resource.openai_client()
        response = await client.chat.completions.create(
            model=rollout_input.model_resource.model_name,
            messages=rollout_input.messages,
            **rollout_input.sampling_params,
        )
        reply = {{"role": "assistant", "content": response.choices[0].message.content or ""}}
        return RolloutOutput(
            agent_output=AgentOutput(messages=[*rollout_input.messages, reply], rollout_metrics=dict(found))
        )
"""


def _ray_ports() -> list[int]:
    """The embedded Ray's GCS port, where the server has written it (the sandbox must not reach it)."""
    current = Path("/tmp/ray/ray_current_cluster")
    if not current.exists():
        return []
    address = current.read_text().strip()
    return [int(address.rsplit(":", 1)[1])] if ":" in address else []


def _spec(models: TinyModels, dataset: Path, workspace: Path, **runtime: object) -> dict[str, object]:
    return {
        "job_name": "attacker",
        "model": str(models.student),
        "teacher_model": str(models.teacher),
        "training_datasets": [str(dataset)],
        "functions": [
            {
                "name": "attacker",
                "type": "rollout",
                "timeout": 120,
                "fcmodel": {"zipdir": str(workspace), "classpath": "attacker.py:Attacker"},
                "runtime": {"memory_size": 1024, **runtime},
            }
        ],
        "hyper_parameters": {
            "max_steps": 2,
            "batch_size": 2,
            "n_rollouts": 2,
            "ppo_mini_batch_size": 4,
            "max_tokens": 24,
            "save_steps": 100,
        },
        "resources": {"student": ENGINE, "teacher": ENGINE, "learner_gpus": 0},
    }


def _training_records(models: TinyModels, folder: Path, count: int) -> Path:
    records = read_jsonl(models.data_dir / "train.jsonl")
    write_jsonl(folder / "train.jsonl", records[:count])
    return folder / "train.jsonl"


def _escaped_processes() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if ESCAPE_MARKER in (process.info["cmdline"] or []):
            found.append(process)
    return found


@pytest.mark.skipif(bwrap_problem() is not None, reason=f"no sandbox on this machine: {bwrap_problem()}")
def test_a_hostile_processor_reaches_nothing_and_the_job_still_trains(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    dataset = _training_records(tiny_models, tmp_path, 8)
    data_dir = tmp_path / "data"
    env = {"OPD_MAX_CONCURRENT_JOBS": "1", "OPD_CANCEL_GRACE_S": str(CANCEL_GRACE_S)}
    server = Server(data_dir, env=env, model_dirs=[TINY_MODELS_DIR])
    server.start(ready_timeout=300, wait_ready=True)
    try:
        victim = OPDClient(server.url, create_key(server.url, "victim"))
        victim_file = tmp_path / "victim.jsonl"
        write_jsonl(victim_file, [{"messages": [{"role": "user", "content": VICTIM_TEXT}]}])
        victim.upload_file(victim_file, purpose="dataset")

        workspace = tmp_path / "workspace"
        workspace.mkdir()
        code = ATTACKER.format(
            admin_key=ADMIN_KEY,
            data_dir=str(data_dir),
            victim_text=VICTIM_TEXT,
            ports=[server.port, *_ray_ports()],
            escape_marker=ESCAPE_MARKER,
        )
        (workspace / "attacker.py").write_text(textwrap.dedent(code))
        attacker = OPDClient(server.url, create_key(server.url, "attacker"))
        job = attacker.submit(_spec(tiny_models, dataset, workspace))
        *events, end = attacker.stream_events(job.id)
        assert isinstance(end, StreamEnd) and end.job is not None
        assert end.job.status == "succeeded", (end.job.error, server.log()[-4000:])
        confinement = [e.message for e in events if "sandbox" in getattr(e, "data", {})]
        steps = [r for r in attacker.metrics(job.id).data if r["kind"] == "train"]
        assert [r["step"] for r in steps] == [1, 2]
        probes = {k: v for k, v in steps[0].items() if k.startswith("rollout/probe_")}
        assert len(probes) == 11, steps[0]
        assert all(v == 1.0 for v in probes.values()), (probes, confinement)
        assert all(r["failed_rollouts"] == 0 for r in steps)
        # The tenant key cannot act as the admin (the key it would have stolen is not in reach anyway).
        denied = httpx.post(
            server.url + "/v1/keys",
            json={"tenant": "x"},
            headers={"Authorization": f"Bearer {attacker.api_key}"},
        )
        assert denied.status_code in (401, 403)
        # The double-forked process died with its sandbox when the job ended.
        deadline = time.monotonic() + 30
        while _escaped_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _escaped_processes()

        # A processor that blocks forever (synchronous sleep in async code, a long timeout): cancel
        # still reaches `cancelled` within the server's bound.
        (workspace / "blocker.py").write_text(BLOCKER)
        spec = _spec(tiny_models, dataset, workspace)
        spec["functions"][0]["fcmodel"]["classpath"] = "blocker.py:Blocker"  # type: ignore[index]
        spec["functions"][0]["timeout"] = 3600  # type: ignore[index]
        blocked_job = attacker.submit(spec)
        for event in attacker.stream_events(blocked_job.id):  # until its processors are loaded
            if isinstance(event, StreamEnd) or " runs in " in event.message:
                break
        time.sleep(3)  # the first rollouts are in the processor's sleep
        asked = time.monotonic()
        attacker.cancel_job(blocked_job.id)
        while attacker.get_job(blocked_job.id).status not in ("cancelled", "failed", "succeeded"):
            assert time.monotonic() - asked < CANCEL_GRACE_S + 30, "cancel did not reach a terminal state"
            time.sleep(0.5)
        assert attacker.get_job(blocked_job.id).status == "cancelled"
    finally:
        server.stop()
        for process in _escaped_processes():
            process.kill()


def test_a_server_whose_nodes_cannot_sandbox_refuses_user_code(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    dataset = _training_records(tiny_models, tmp_path, 4)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "attacker.py").write_text(
        "from opd_trainer.sdk import AbstractRolloutProcessor\n\n"
        "class Attacker(AbstractRolloutProcessor):\n    async def process(self, rollout_input):\n"
        "        raise RuntimeError('must never run')\n"
    )
    # OPD_BWRAP names a bubblewrap that does not exist: as on a node whose runtime forbids namespaces.
    env = {"OPD_MAX_CONCURRENT_JOBS": "1", "OPD_BWRAP": str(tmp_path / "no-bwrap-here")}
    server = Server(tmp_path / "data", env=env, model_dirs=[TINY_MODELS_DIR])
    server.start(ready_timeout=300, wait_ready=True)
    try:
        client = OPDClient(server.url, create_key(server.url, "tenant"))
        job = client.submit(_spec(tiny_models, dataset, workspace))
        *_, end = client.stream_events(job.id)
        assert isinstance(end, StreamEnd) and end.job is not None
        assert end.job.status == "failed", server.log()[-4000:]
        error = end.job.error
        assert error is not None and "sandbox cannot start" in error.message, error
        assert error.param == "functions", error
    finally:
        server.stop()
