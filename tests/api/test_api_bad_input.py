"""Table-driven bad input: every case is a clean 4xx in the one error shape, naming the field, and the
server keeps serving afterwards."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from apiserver import ADMIN_KEY, WORKSPACE, Server, Tenant, jsonl, record, zip_bytes

KB = 1024


@dataclass(frozen=True)
class Case:
    name: str
    send: Callable[[Tenant, Tenant], httpx.Response]
    status: int
    param: str | None
    message: str = ""  # a fragment the message must contain


def upload(
    content: bytes, purpose: str = "dataset", filename: str = "f"
) -> Callable[[Tenant, Tenant], httpx.Response]:
    return lambda t, _o: t.http.post(
        "/v1/files", files={"file": (filename, content)}, data={"purpose": purpose}
    )


def submit(**overrides: Any) -> Callable[[Tenant, Tenant], httpx.Response]:
    def send(t: Tenant, _o: Tenant) -> httpx.Response:
        dataset = t.upload(jsonl([record()]))
        return t.http.post("/v1/opd/jobs", json=t.spec(dataset["id"], **overrides))

    return send


def shaped(**overrides: Any) -> Callable[[Tenant, Tenant], httpx.Response]:
    """`submit` with student and teacher a model whose shape and weights pre-flight can read."""

    def send(t: Tenant, _o: Tenant) -> httpx.Response:
        dataset = t.upload(jsonl([record()]))
        models = {"model": t.models["shaped"], "teacher_model": t.models["shaped"]}
        return t.http.post("/v1/opd/jobs", json=t.spec(dataset["id"], **models, **overrides))

    return send


def submit_raw(
    build: Callable[[Tenant, dict[str, Any]], dict[str, Any]],
) -> Callable[[Tenant, Tenant], httpx.Response]:
    def send(t: Tenant, _o: Tenant) -> httpx.Response:
        dataset = t.upload(jsonl([record()]))
        return t.http.post("/v1/opd/jobs", json=build(t, t.spec(dataset["id"])))

    return send


def with_component(
    classpath: str, entries: dict[str, bytes] | None = None, runtime: dict[str, Any] | None = None
) -> Callable[[Tenant, Tenant], httpx.Response]:
    def send(t: Tenant, _o: Tenant) -> httpx.Response:
        workspace = t.upload(zip_bytes(entries or {"functions/__init__.py": b""}), "workspace", "ws.zip")
        dataset = t.upload(jsonl([record()]))
        component = {
            "name": "score",
            "type": "reward",
            "fcmodel": {"workspace": workspace["id"], "classpath": classpath},
            **({"runtime": runtime} if runtime is not None else {}),
        }
        return t.http.post("/v1/opd/jobs", json=t.spec(dataset["id"], functions=[component]))

    return send


def transition(
    setup: list[str], action: str, method: str = "POST"
) -> Callable[[Tenant, Tenant], httpx.Response]:
    def send(t: Tenant, _o: Tenant) -> httpx.Response:
        job = t.job()
        for step in setup:
            assert t.http.post(f"/v1/opd/jobs/{job['id']}/{step}").is_success
        path = f"/v1/opd/jobs/{job['id']}" + ("" if method == "DELETE" else f"/{action}")
        return t.http.request(method, path)

    return send


def as_other(path: str, method: str = "GET") -> Callable[[Tenant, Tenant], httpx.Response]:
    def send(t: Tenant, other: Tenant) -> httpx.Response:
        job = t.job()
        return other.http.request(
            method, path.format(job=job["id"], file=job["spec"]["training_datasets"][0])
        )

    return send


def bomb() -> bytes:
    import io

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        archive.writestr("functions/zeros.py", b"\0" * (24 * 1024 * 1024))  # ~24 KB compressed
    return buffer.getvalue()


def headers(value: str | None) -> Callable[[Tenant, Tenant], httpx.Response]:
    def send(t: Tenant, _o: Tenant) -> httpx.Response:
        sent = {"Authorization": value} if value is not None else {}
        return httpx.get(str(t.http.base_url) + "/v1/opd/jobs", headers=sent)

    return send


CASES = [
    # datasets
    Case(
        "jsonl: bad lines are listed by number",
        upload(
            b'{"messages": [{"role": "user", "content": "hi"}]}\n'
            b'{"messages": [{"role": "assistant", "content": "x"}]}\nnot json\n'
        ),
        400,
        "file",
        "line 2",
    ),
    Case(
        "jsonl: invalid JSON names its line",
        upload(b'{"messages": []}\n{oops\n'),
        400,
        "file",
        "line 2: not valid JSON",
    ),
    Case(
        "jsonl: wrong type of rollout_extra",
        upload(jsonl([record(rollout_extra=[1])])),
        400,
        "file",
        "line 1: rollout_extra",
    ),
    Case("jsonl: unknown record field", upload(jsonl([record(answer="x")])), 400, "file", "unknown field"),
    Case("jsonl: not UTF-8", upload(b"\xff\xfe\x00"), 400, "file", "UTF-8"),
    Case("jsonl: empty", upload(b"\n\n"), 400, "file", "no records"),
    Case("upload: unknown purpose", upload(b"x", purpose="weights"), 422, "purpose"),
    Case(
        "upload: no file part",
        lambda t, _o: t.http.post("/v1/files", data={"purpose": "dataset"}),
        422,
        "file",
    ),
    Case("upload: oversized", upload(b"x" * (300 * KB)), 413, None, "exceeds"),
    # workspaces
    Case("zip: not a zip", upload(b"hello", "workspace"), 400, "file", "zip archive"),
    Case("zip: traversal", upload(zip_bytes({"../evil.py": b"x"}), "workspace"), 400, "file", "'..'"),
    Case(
        "zip: nested traversal",
        upload(zip_bytes({"a/../../evil.py": b"x"}), "workspace"),
        400,
        "file",
        "'..'",
    ),
    Case(
        "zip: absolute path", upload(zip_bytes({"/etc/cron.d/x": b"x"}), "workspace"), 400, "file", "absolute"
    ),
    Case(
        "zip: symlink",
        upload(zip_bytes({"link": b"/etc/passwd"}, {"link": 0o120777}), "workspace"),
        400,
        "file",
        "link",
    ),
    Case(
        "zip: device file",
        upload(zip_bytes({"dev": b""}, {"dev": 0o020644}), "workspace"),
        400,
        "file",
        "regular",
    ),
    Case("zip: bomb", upload(bomb(), "workspace"), 400, "file", "zip bomb"),
    # job specs
    Case(
        "spec: wrong type",
        submit(hyper_parameters={"batch_size": "eight"}),
        422,
        "hyper_parameters.batch_size",
    ),
    Case(
        "spec: out of range",
        submit(hyper_parameters={"learning_rate": -1}),
        422,
        "hyper_parameters.learning_rate",
    ),
    Case("spec: unknown field", submit(epochs=3), 422, "epochs", "Extra inputs"),
    Case("spec: unknown nested field", submit(hyper_parameters={"lr": 1}), 422, "hyper_parameters.lr"),
    Case(
        "spec: missing field",
        submit_raw(lambda _t, s: {k: v for k, v in s.items() if k != "model"}),
        422,
        "model",
    ),
    Case(
        "spec: not JSON",
        lambda t, _o: t.http.post("/v1/opd/jobs", content=b"{", headers={"content-type": "application/json"}),
        422,
        None,
    ),
    Case(
        "spec: unknown dataset id",
        submit(training_datasets=["file-doesnotexist"]),
        404,
        "training_datasets.0",
    ),
    Case(
        "spec: local dataset path",
        submit(validation_datasets=["/etc/passwd.jsonl"]),
        400,
        "validation_datasets.0",
        "upload",
    ),
    Case(
        "spec: workspace id as dataset",
        submit_raw(
            lambda t, s: {**s, "training_datasets": [t.upload(zip_bytes({"a.py": b""}), "workspace")["id"]]}
        ),
        400,
        "training_datasets.0",
        "workspace",
    ),
    Case(
        "spec: local zipdir",
        submit(
            functions=[{"name": "r", "type": "reward", "fcmodel": {"zipdir": "/tmp", "classpath": "a.B"}}]
        ),
        400,
        "functions.r.fcmodel.zipdir",
    ),
    Case(
        "spec: zipdir and workspace",
        submit(
            functions=[
                {
                    "name": "r",
                    "type": "reward",
                    "fcmodel": {"zipdir": "/tmp", "workspace": "file-x", "classpath": "a.B"},
                }
            ]
        ),
        422,
        "functions.0.fcmodel",
    ),
    Case(
        "spec: missing classpath module",
        with_component("functions.missing.MyReward"),
        400,
        "functions.score.fcmodel.classpath",
        "functions.missing",
    ),
    Case(
        "spec: malformed classpath",
        with_component("not a classpath"),
        400,
        "functions.score.fcmodel.classpath",
    ),
    Case(
        "spec: model outside the approved folders",
        submit(model="/nonexistent/student"),
        400,
        "model",
        "approved",
    ),
    Case(
        "spec: teacher outside the approved folders",
        submit(teacher_model="/etc"),
        400,
        "teacher_model",
        "approved",
    ),
    Case(
        "spec: model folder missing in an approved folder",
        submit_raw(lambda t, s: {**s, "model": str(Path(t.models["student"]).parent / "missing")}),
        400,
        "model",
        "not found",
    ),
    Case(
        "spec: max_length beyond the models' context",
        submit(hyper_parameters={"max_steps": 3, "batch_size": 2, "max_length": 8192}),
        400,
        "hyper_parameters.max_length",
        "context of 4096",
    ),
    Case(
        "spec: the memory plan refuses a job that cannot fit, with each role's numbers",
        shaped(resources={"student": {"kv_cache_memory_bytes": 64 * 1024**4}}),
        400,
        "resources.student.kv_cache_memory_bytes",
        "memory plan exceeds",
    ),
    Case(
        "spec: a LoRA target module the student lacks",
        shaped(
            hyper_parameters={"max_steps": 3, "batch_size": 2, "lora": {"r": 8, "target_modules": ["c_attn"]}}
        ),
        400,
        "hyper_parameters.lora.target_modules",
        "'c_attn' is not a module of the student",
    ),
    Case(
        "spec: a LoRA rank of 0",
        submit(hyper_parameters={"max_steps": 3, "batch_size": 2, "lora": {"r": 0}}),
        422,
        "hyper_parameters.lora.r",
    ),
    Case(
        "spec: requirements.txt names a server file through a pip option",
        with_component(
            "functions/reward.py:MyReward",
            {**WORKSPACE, "requirements.txt": b"numpy\n--requirement=/etc/passwd\n"},
        ),
        400,
        "functions.score.fcmodel.workspace",
        "requirements.txt line 2 is a pip option",
    ),
    Case(
        "spec: requirements.txt installs from a URL",
        with_component(
            "functions/reward.py:MyReward",
            {**WORKSPACE, "requirements.txt": b"evil @ https://example.com/e.whl"},
        ),
        400,
        "functions.score.fcmodel.workspace",
        "requirements.txt line 1 (evil): a URL, path or archive file",
    ),
    Case(
        "spec: runtime.env sets a variable the loader reads",
        with_component("functions/reward.py:MyReward", WORKSPACE, runtime={"env": {"LD_PRELOAD": "x.so"}}),
        422,
        "functions.0.runtime",
        "functions.score.runtime.env.LD_PRELOAD: not settable by a job",
    ),
    Case(
        "spec: a tenant's tracking URI is a file on the server",
        submit(report_to=["mlflow"], mlflow_tracking_uri="sqlite:////srv/opd-data/opd.db"),
        400,
        "mlflow_tracking_uri",
        "local tracking stores",
    ),
    Case(
        "spec: a tenant's tracking server the operator did not allow",
        submit(report_to=["mlflow"], mlflow_tracking_uri="http://169.254.169.254/latest"),
        400,
        "mlflow_tracking_uri",
        "OPD_TRACKER_ALLOWED_URIS",
    ),
    Case(
        "spec: teacher tokenizer differs",
        submit_raw(lambda t, s: {**s, "teacher_model": t.models["other"]}),
        400,
        "teacher_model",
        "tokenizer",
    ),
    Case(
        "spec: body too large",
        submit(
            job_name="x" * 100,
            hyper_parameters={"max_steps": 1},
            resources={"student": {"dtype": "x" * (70 * KB)}},
        ),
        413,
        None,
    ),
    # auth
    Case("auth: no key", headers(None), 401, "Authorization"),
    Case("auth: wrong key", headers("Bearer opd-not-a-key"), 401, "Authorization", "unknown"),
    Case("auth: not bearer", headers("Basic dXNlcjpwYXNz"), 401, "Authorization"),
    Case("auth: admin key on a tenant route", headers(f"Bearer {ADMIN_KEY}"), 403, "Authorization", "admin"),
    Case(
        "auth: tenant key creating keys",
        lambda t, _o: t.http.post("/v1/keys", json={"tenant": "x"}),
        401,
        "Authorization",
    ),
    Case(
        "keys: bad tenant name",
        lambda t, _o: httpx.post(
            str(t.http.base_url) + "/v1/keys",
            json={"tenant": "a b/c"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        ),
        422,
        "tenant",
    ),
    # tenants
    Case("tenant: another tenant's job", as_other("/v1/opd/jobs/{job}"), 404, "job_id"),
    Case("tenant: another tenant's job events", as_other("/v1/opd/jobs/{job}/events"), 404, "job_id"),
    Case("tenant: cancel another tenant's job", as_other("/v1/opd/jobs/{job}/cancel", "POST"), 404, "job_id"),
    Case("tenant: another tenant's file", as_other("/v1/files/{file}"), 404, "file_id"),
    Case(
        "tenant: another tenant's file in a spec",
        lambda t, o: o.http.post("/v1/opd/jobs", json=o.spec(t.job()["spec"]["training_datasets"][0])),
        404,
        "training_datasets.0",
    ),
    # transitions
    Case("transition: resume a queued job", transition([], "resume"), 409, "status", "cannot resume"),
    Case("transition: pause a cancelled job", transition(["cancel"], "pause"), 409, "status"),
    Case("transition: cancel a cancelled job", transition(["cancel"], "cancel"), 409, "status"),
    Case("transition: resume a cancelled job", transition(["pause", "cancel"], "resume"), 409, "status"),
    Case(
        "transition: delete an unfinished job", transition(["pause"], "", "DELETE"), 409, "status", "finished"
    ),
    # query parameters
    Case("query: limit 0", lambda t, _o: t.http.get("/v1/opd/jobs", params={"limit": 0}), 422, "limit"),
    Case(
        "query: unknown status",
        lambda t, _o: t.http.get("/v1/opd/jobs", params={"status": "done"}),
        422,
        "status",
    ),
    Case(
        "query: unknown after",
        lambda t, _o: t.http.get("/v1/opd/jobs", params={"after": "opdjob-x"}),
        404,
        "after",
    ),
    Case(
        "query: unknown file purpose",
        lambda t, _o: t.http.get("/v1/files", params={"purpose": "x"}),
        422,
        "purpose",
    ),
    Case(
        "query: negative event cursor",
        lambda t, _o: t.http.get(f"/v1/opd/jobs/{t.job()['id']}/events", params={"after": -5}),
        422,
        "after",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_a_clean_4xx_naming_the_field(
    case: Case, server: Server, tenant: Tenant, other_tenant: Tenant
) -> None:
    response = case.send(tenant, other_tenant)
    assert response.status_code == case.status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "param"}, body
    assert body["error"]["param"] == case.param, body
    assert case.message in body["error"]["message"], body
    assert "Traceback" not in response.text
    assert httpx.get(server.url + "/healthz").status_code == 200
    assert tenant.http.get("/v1/files").status_code == 200  # the server keeps serving this tenant


def test_the_server_still_works_after_every_bad_input(tenant: Tenant) -> None:
    job = tenant.job()
    assert tenant.http.get(f"/v1/opd/jobs/{job['id']}").json()["status"] == "queued"
