"""`opd submit / jobs / get / logs / cancel / keys create` against the real server, run in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from apiserver import ADMIN_KEY, Server, Tenant, jsonl, record

from opd_trainer.cli.main import main


@pytest.fixture
def job_file(tmp_path: Path, tenant: Tenant, workspace_dir: Path) -> Path:
    (tmp_path / "train.jsonl").write_bytes(jsonl([record("a"), record("b")]))
    spec = {
        "job_name": "cli-job",
        "model": tenant.models["student"],
        "teacher_model": tenant.models["teacher"],
        "training_datasets": ["train.jsonl"],  # relative to the job file, like `opd train`
        "validation_datasets": ["train.jsonl"],
        "functions": [
            {
                "name": "score",
                "type": "reward",
                "fcmodel": {"zipdir": "workspace", "classpath": "functions/reward.py:MyReward"},
            }
        ],
        "hyper_parameters": {"max_steps": 2, "batch_size": 2},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, server: Server, tenant: Tenant) -> Tenant:
    monkeypatch.setenv("OPD_BASE_URL", server.url)
    monkeypatch.setenv("OPD_API_KEY", tenant.key)
    return tenant


def test_submit_uploads_local_files_and_the_job_can_be_managed(
    cli_env: Tenant, job_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["submit", str(job_file)]) == 0
    job_id = capsys.readouterr().out.split()[1]
    job = cli_env.client.get_job(job_id)
    assert job.status == "queued"
    dataset = job.spec["training_datasets"][0]
    assert dataset.startswith("file-") and job.spec["validation_datasets"] == [dataset]  # uploaded once
    assert job.spec["functions"][0]["fcmodel"]["workspace"].startswith("file-")

    assert main(["jobs"]) == 0
    assert job_id in capsys.readouterr().out
    assert main(["get", job_id]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == job_id
    assert main(["cancel", job_id]) == 0
    assert capsys.readouterr().out.strip() == f"{job_id}: cancelled"
    assert main(["logs", job_id]) == 0
    assert "[status] cancel requested: queued -> cancelled" in capsys.readouterr().out
    assert main(["logs", "-f", job_id]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "-- job cancelled"


def test_keys_create(
    server: Server, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OPD_ADMIN_KEY", ADMIN_KEY)
    assert main(["keys", "create", "--tenant", "cli-tenant", "--base-url", server.url]) == 0
    key = capsys.readouterr().out.splitlines()[-1]
    assert main(["jobs", "--base-url", server.url, "--api-key", key]) == 0


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda s: s["hyper_parameters"].update(lr=1),
            "error: hyper_parameters.lr: Extra inputs are not permitted",
        ),
        (
            lambda s: s.update(training_datasets=["missing.jsonl"]),
            "error: training_datasets.0: missing.jsonl is neither a local file nor a file id",
        ),
        (
            lambda s: s["functions"][0]["fcmodel"].update(classpath="functions.nope.X"),
            "error: functions.score.fcmodel.classpath: ",
        ),
        (
            lambda s: s.update(teacher_model="/nonexistent"),
            "error: teacher_model: teacher_model '/nonexistent' is not an approved model",
        ),
    ],
)
def test_bad_job_files_print_one_error_line_and_exit_2(
    cli_env: Tenant, job_file: Path, capsys: pytest.CaptureFixture[str], edit, expected: str
) -> None:
    spec = yaml.safe_load(job_file.read_text())
    edit(spec)
    job_file.write_text(yaml.safe_dump(spec))
    assert main(["submit", str(job_file)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(expected), captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err


def test_missing_key_and_unknown_job(
    server: Server, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cli_env: Tenant
) -> None:
    assert main(["get", "opdjob-nope"]) == 2
    assert capsys.readouterr().err.startswith("error: job_id: no job with id 'opdjob-nope'")
    monkeypatch.delenv("OPD_API_KEY")
    assert main(["jobs"]) == 2
    assert capsys.readouterr().err.startswith("error: api_key: set OPD_API_KEY")
    assert main(["jobs", "--api-key", "x", "--base-url", "http://127.0.0.1:9"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_submit_follow_streams_until_the_job_ends(
    cli_env: Tenant, job_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import threading
    import time

    def cancel_when_submitted() -> None:
        for _ in range(300):
            jobs = cli_env.client.list_jobs(status="queued").data
            if jobs:
                cli_env.client.cancel_job(jobs[0].id)
                return
            time.sleep(0.1)

    canceller = threading.Thread(target=cancel_when_submitted)
    canceller.start()
    assert main(["submit", str(job_file), "--follow"]) == 1  # followed to the end; it did not succeed
    canceller.join()
    out = capsys.readouterr().out
    assert "[status] cancel requested: queued -> cancelled" in out
    assert out.strip().endswith(": cancelled")


def test_every_job_command_and_json_output(
    cli_env: Tenant, job_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(*argv: str) -> str:
        assert main(list(argv)) == 0, capsys.readouterr().err
        return capsys.readouterr().out

    job = json.loads(run("submit", str(job_file), "-o", "json"))
    job_id = job["id"]
    assert job["status"] == "queued" and job["job_name"] == "cli-job"
    assert run("pause", job_id).strip() == f"{job_id}: paused"
    assert json.loads(run("resume", job_id, "-o", "json"))["status"] == "queued"
    page = json.loads(run("jobs", "-o", "json"))
    assert job_id in [j["id"] for j in page["data"]] and page["has_more"] is False
    assert json.loads(run("checkpoints", job_id, "-o", "json")) == []  # not started: none yet
    assert run("checkpoints", job_id).splitlines()[0].startswith("id")
    assert json.loads(run("metrics", job_id, "-o", "json"))["data"] == []
    assert run("cancel", job_id).strip() == f"{job_id}: cancelled"
    # Every event so far, one JSON object per line, in order; the text form shows the same events.
    events = [json.loads(line) for line in run("logs", job_id, "-o", "json").splitlines()]
    assert [e["id"] for e in events] == sorted(e["id"] for e in events) and len(events) >= 4
    assert len(run("logs", job_id).splitlines()) == len(events)
    assert run("delete", job_id).strip() == f"deleted {job_id}"
    assert main(["get", job_id]) == 2
    assert "no job with id" in capsys.readouterr().err


def test_events_page_to_the_end(cli_env: Tenant, job_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["submit", str(job_file), "-o", "json"]) == 0
    job_id = json.loads(capsys.readouterr().out)["id"]
    for _ in range(3):
        cli_env.client.pause_job(job_id)
        cli_env.client.resume_job(job_id)
    one_page = cli_env.client.events(job_id, limit=1000).data
    assert len(one_page) >= 7
    assert list(cli_env.client.iter_events(job_id, page_size=2)) == one_page  # pages of two, no gap
    assert list(cli_env.client.iter_events(job_id, after=one_page[2].id)) == one_page[3:]


def test_files_commands(cli_env: Tenant, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dataset = tmp_path / "shaped-differently.jsonl"
    dataset.write_bytes(jsonl([record("x"), record("y"), record("z")]))
    assert main(["files", "upload", str(dataset), "-o", "json"]) == 0
    uploaded = json.loads(capsys.readouterr().out)
    assert uploaded["purpose"] == "dataset" and uploaded["samples"] == 3
    assert main(["files", "list", "--purpose", "dataset"]) == 0
    listing = capsys.readouterr().out
    assert uploaded["id"] in listing and "shaped-differently.jsonl" in listing
    assert main(["files", "delete", uploaded["id"]]) == 0
    assert capsys.readouterr().out.strip() == f"deleted {uploaded['id']}"
    assert main(["files", "list", "-o", "json"]) == 0
    assert uploaded["id"] not in [f["id"] for f in json.loads(capsys.readouterr().out)]
    assert main(["files", "upload", str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err.startswith("error: path: ")


def test_keys_list_and_revoke(
    server: Server, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OPD_BASE_URL", server.url)
    monkeypatch.delenv("OPD_ADMIN_KEY", raising=False)
    assert main(["keys", "create", "--tenant", "revoked-tenant", "--admin-key", ADMIN_KEY, "-o", "json"]) == 0
    key = json.loads(capsys.readouterr().out)
    # A tenant sees its own keys (prefixes only); the admin sees every tenant's.
    assert main(["keys", "list", "--api-key", key["key"], "-o", "json"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert [k["id"] for k in own] == [key["id"]] and all(k.get("key") is None for k in own)
    assert main(["keys", "list", "--admin-key", ADMIN_KEY]) == 0
    assert key["id"] in capsys.readouterr().out
    # Usage: a tenant with no job has used nothing; the admin sees every tenant's row.
    assert main(["usage", "--api-key", key["key"], "-o", "json"]) == 0
    [mine] = json.loads(capsys.readouterr().out)
    assert mine["tenant"] == "revoked-tenant" and mine["jobs"] == 0 and mine["usage"] == {}
    assert main(["usage", "--admin-key", ADMIN_KEY]) == 0
    table = capsys.readouterr().out
    assert table.startswith("tenant") and "revoked-tenant" in table
    assert main(["keys", "revoke", key["id"]]) == 2  # no admin key
    assert "error: admin_key: set OPD_ADMIN_KEY" in capsys.readouterr().err
    assert main(["keys", "revoke", key["id"], "--admin-key", ADMIN_KEY]) == 0
    assert capsys.readouterr().out.strip() == f"revoked {key['id']}"
    assert main(["jobs", "--api-key", key["key"]]) == 2  # refused from now on
    assert capsys.readouterr().err.startswith("error: ")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == "opd 0.1.0"


def test_checkpoints_list_with_their_metrics_and_download_as_model_folders(
    cli_env: Tenant,
    other_tenant: Tenant,
    server: Server,
    job_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The run dir is laid out as the driver writes it (checkpoint folders, metrics.jsonl) by hand
    here, since this server runs no jobs; `test_api_end_to_end` downloads a trained one."""
    import shutil
    import zipfile

    from opd_trainer.storage.checkpoints import CheckpointStore
    from opd_trainer.wire.checkpoint import CheckpointState, CursorState

    assert main(["submit", str(job_file), "-o", "json"]) == 0
    job_id = json.loads(capsys.readouterr().out)["id"]
    run_dir = server.data_dir / "runs" / job_id
    store = CheckpointStore(run_dir / "checkpoints")
    student = Path(cli_env.models["student"])
    for step in (2, 4):
        staging = store.staging(step)
        shutil.copytree(student, staging / "student")
        (staging / "student" / "weights.bin").write_bytes(bytes(range(256)) * 4096 * step)  # 1-2 MB
        cursor = CursorState(epoch=0, position=step)
        store.commit(staging, CheckpointState(step=step, cursor=cursor, total_steps=4))
    records = [{"kind": "train", "step": s, "reverse_kl": 1.0 / s, "note": "x"} for s in (1, 2, 3, 4)]
    records.append({"kind": "eval", "step": 4, "exact_match": 0.5})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    checkpoints = cli_env.client.checkpoints(job_id)
    assert [c.id for c in checkpoints] == ["step-000002", "step-000004"]
    assert checkpoints[0].metrics == {"reverse_kl": 0.5} and checkpoints[0].eval is None
    assert checkpoints[1].eval == {"exact_match": 0.5} and checkpoints[1].created_at > 0
    # Named by the job's id, not by the server's folder; a new job of the tenant may start from one.
    assert (checkpoints[1].path, checkpoints[1].student) == (
        f"{job_id}/checkpoints/step-000004",
        f"{job_id}/checkpoints/step-000004/student",
    )
    dataset = cli_env.upload(jsonl([record("c")]))
    again = cli_env.http.post("/v1/opd/jobs", json=cli_env.spec(dataset["id"], model=checkpoints[1].student))
    assert again.status_code == 201, again.text
    assert again.json()["spec"]["model"] == checkpoints[1].student

    # No fine_tuned_model before the job succeeded: the command says so and which field to give.
    assert main(["download", job_id]) == 2
    assert capsys.readouterr().err.startswith("error: checkpoint_id: ")
    target = tmp_path / "downloaded"
    assert main(["download", job_id, "--checkpoint", "step-000004", "--to", str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    source = run_dir / "checkpoints" / "step-000004" / "student"
    files = sorted(p.relative_to(source) for p in source.rglob("*") if p.is_file())
    assert sorted(p.relative_to(target) for p in target.rglob("*") if p.is_file()) == files
    assert all((target / f).read_bytes() == (source / f).read_bytes() for f in files)
    assert main(["download", job_id, "--checkpoint", "step-000004", "--to", str(target)]) == 2  # exists

    # The raw route: a zip with one top folder; another tenant gets a 404, as for a missing one.
    response = cli_env.http.get(f"/v1/opd/jobs/{job_id}/checkpoints/step-000002/content")
    assert response.status_code == 200 and response.headers["content-type"] == "application/zip"
    (tmp_path / "raw.zip").write_bytes(response.content)
    with zipfile.ZipFile(tmp_path / "raw.zip") as archive:
        assert {name.split("/")[0] for name in archive.namelist()} == {f"{job_id}-step-000002"}
    for http, checkpoint in ((other_tenant.http, "step-000002"), (cli_env.http, "step-000003")):
        missing = http.get(f"/v1/opd/jobs/{job_id}/checkpoints/{checkpoint}/content")
        assert missing.status_code == 404, missing.text
