"""The opd-trainer Helm chart, checked without a cluster: `helm lint` and `helm template` through
helm-python-sdk for each install scenario, every rendered object against the pinned Kubernetes
version's schemas (kubernetes-validate, strict) and the custom resources against their vendored CRD
schemas (tests/deploy/schemas), then what each scenario must actually produce.

Run: `.venv/bin/pytest tests/deploy -q` (no network, no helm binary, no cluster; a few seconds).
"""

from __future__ import annotations

import base64
import copy
import json
import re
from collections.abc import Iterator
from functools import cache
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from chart_rendering import (
    CHART_DIR,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    SCENARIOS,
    SCHEMAS_DIR,
    VALUES_DIR,
    Rendered,
    env_of,
    load_values,
    pod_templates,
    ray_container,
    render,
    worker_groups,
)

# Custom resources the chart renders → their vendored CRD schema (see schemas/README.md).
CRD_SCHEMAS = {
    ("ray.io/v1", "RayCluster"): "raycluster-ray.io-v1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
}
# KubeRay rejects longer RayCluster names (utils.MaxRayClusterNameLength).
MAX_RAYCLUSTER_NAME = 53
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
FULLNAME = f"{RELEASE}-opd-trainer"


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(SCENARIOS))
def scenario(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def rendered(chart: helm.Chart, scenario: str) -> Rendered:
    return render(chart, load_values(SCENARIOS[scenario]), scenario)


# -- schemas ------------------------------------------------------------------------------------


def strict_crd_schema(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected, as `kubectl apply`'s strict field validation does.

    A structural CRD schema leaves `additionalProperties` out (the API server prunes or, with
    fieldValidation=Strict, rejects unknown fields); JSON Schema would accept them silently.
    """
    if isinstance(schema, list):
        return [strict_crd_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: strict_crd_schema(value) for key, value in schema.items()}
    if (
        "properties" in strict
        and "additionalProperties" not in strict
        and not strict.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    return strict


@cache
def crd_validator(filename: str) -> jsonschema.Draft7Validator:
    schema = json.loads((SCHEMAS_DIR / filename).read_text())
    return jsonschema.Draft7Validator(strict_crd_schema(schema))


def schema_errors(obj: dict[str, Any]) -> list[str]:
    """Every schema violation of one rendered object, as 'path: message'."""
    crd_schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if crd_schema is not None:
        errors = crd_validator(crd_schema).iter_errors(obj)
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
    try:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [error.message]
    return []


# -- helpers over rendered objects ---------------------------------------------------------------


def gpus(group: dict[str, Any]) -> int:
    limits = ray_container(group["template"]).get("resources", {}).get("limits", {})
    return int(limits.get("nvidia.com/gpu", 0))


def api_container(rendered: Rendered) -> dict[str, Any]:
    container: dict[str, Any] = rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    return container


def configmap_data(rendered: Rendered) -> dict[str, str]:
    data: dict[str, str] = rendered.one("ConfigMap")["data"]
    return data


def arg_after(container: dict[str, Any], flag: str) -> str:
    args: list[str] = container["args"]
    return args[args.index(flag) + 1]


# -- every scenario -------------------------------------------------------------------------------


def test_helm_lint_is_clean(scenario: str) -> None:
    """`helm lint --strict --kube-version` reports no error and no warning."""
    report = helm.lint(
        CHART_DIR,
        load_values(SCENARIOS[scenario]),
        strict=True,
        namespace=NAMESPACE,
        kube_version=f"v{KUBE_VERSION}",
    )
    findings = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not findings, json.dumps(report, indent=1)


def test_every_object_matches_its_schema(rendered: Rendered) -> None:
    """Kubernetes objects against kubernetes-validate's schemas, custom resources against their CRD."""
    problems = {
        f"{obj['kind']}/{obj['metadata']['name']}": errors
        for obj in rendered.objects
        if (errors := schema_errors(obj))
    }
    assert not problems, json.dumps(problems, indent=1)


def test_objects_are_namespaced_and_labelled(rendered: Rendered) -> None:
    names = [(obj["kind"], obj["metadata"]["name"]) for obj in rendered.objects]
    assert len(names) == len(set(names)), names
    for obj in rendered.objects:
        assert obj["metadata"]["namespace"] == NAMESPACE, obj["kind"]
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE, obj["kind"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm", obj["kind"]


def test_pods_run_as_non_root(rendered: Rendered) -> None:
    """(No service-account token either: test_isolation.py.)"""
    for where, template in pod_templates(rendered):
        security = template["spec"]["securityContext"]
        assert security["runAsNonRoot"] is True, where
        assert security["runAsUser"] != 0, where
        for container in template["spec"]["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, where


def test_api_server_probes_and_command(rendered: Rendered) -> None:
    container = api_container(rendered)
    assert container["args"][0] == "serve"
    assert arg_after(container, "--host") == "0.0.0.0"
    port = int(arg_after(container, "--port"))
    assert {"name": "http", "containerPort": port, "protocol": "TCP"} in container["ports"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["limits"] and container["resources"]["requests"]
    data_dir = arg_after(container, "--data-dir")
    assert configmap_data(rendered)["OPD_DATA_DIR"] == data_dir
    assert {"name": "data", "mountPath": data_dir} in container["volumeMounts"]
    # --ray-address and RAY_ADDRESS (seen by `opd` run through kubectl exec) agree; Ray pods, which
    # share the ConfigMap, keep the RAY_ADDRESS KubeRay gives them.
    assert env_of(container)["RAY_ADDRESS"]["value"] == arg_after(container, "--ray-address")
    assert "RAY_ADDRESS" not in configmap_data(rendered)
    # With the chart's RayCluster, an init container waits for the head's Ray Client port first.
    init = rendered.one("Deployment")["spec"]["template"]["spec"].get("initContainers", [])
    if rendered.of_kind("RayCluster"):
        (wait,) = init
        assert wait["command"][:2] == ["python", "-c"]
        script = wait["command"][2]
        compile(script, "wait-for-ray-head", "exec")
        cluster = rendered.one("RayCluster")["metadata"]["name"]
        assert f'("{cluster}-head-svc", 10001)' in script
    else:
        assert init == []
    service = rendered.one("Service")
    assert service["spec"]["selector"] == rendered.one("Deployment")["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_admin_key_comes_from_a_secret(rendered: Rendered) -> None:
    env = env_of(api_container(rendered))
    ref = env["OPD_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
    secrets = {obj["metadata"]["name"]: obj for obj in rendered.of_kind("Secret")}
    if ref["name"] in secrets:
        assert len(secrets[ref["name"]]["data"][ref["key"]]) > 0
    assert "OPD_ADMIN_KEY" not in configmap_data(rendered)
    assert "DATABASE_URL" not in configmap_data(rendered)


@pytest.mark.parametrize("ray_scenario", [name for name in SCENARIOS if name != "existing-ray"])
def test_raycluster_passes_kuberay_admission_checks(
    rendered_by_scenario: dict[str, Rendered], ray_scenario: str
) -> None:
    """What KubeRay's operator validates beyond the CRD schema (utils/validation.go), and the
    /dev/shm every Ray pod needs."""
    rendered = rendered_by_scenario[ray_scenario]
    cluster = rendered.one("RayCluster")
    name = cluster["metadata"]["name"]
    assert len(name) <= MAX_RAYCLUSTER_NAME and DNS_1035_LABEL.match(name), name
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    groups = spec["workerGroupSpecs"]
    assert len({group["groupName"] for group in groups}) == len(groups)
    for group in groups:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
    for where, template in pod_templates(rendered):
        if not where.startswith("ray"):
            continue
        container = ray_container(template)
        assert container["image"].startswith("opd-trainer:") or "/" in container["image"], where
        volumes = {volume["name"]: volume for volume in template["spec"]["volumes"]}
        mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory" and shm["sizeLimit"], where
        # Every Ray pod but the user-code group's has the data volume (ray.common.mountDataVolume).
        has_data = {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
        assert has_data != (where == "ray group user-code"), where
    # The API reaches the head through Ray Client on the head Service KubeRay creates.
    address = env_of(api_container(rendered))["RAY_ADDRESS"]["value"]
    assert address == f"ray://{name}-head-svc.{NAMESPACE}.svc:10001"
    head_ports = {
        p["name"]: p["containerPort"] for p in ray_container(spec["headGroupSpec"]["template"])["ports"]
    }
    assert head_ports["client"] == 10001


# -- what each scenario produces ---------------------------------------------------------------------


def test_default_install(rendered_by_scenario: dict[str, Rendered]) -> None:
    rendered = rendered_by_scenario["default"]
    kinds = sorted(obj["kind"] for obj in rendered.objects)
    assert kinds == [
        "ConfigMap",
        "Deployment",
        *["NetworkPolicy"] * 4,  # API, head, CPU/GPU workers, user-code group
        "PersistentVolumeClaim",
        "Pod",  # the `helm test` pod
        "RayCluster",
        "Secret",
        "Service",
    ]
    groups = worker_groups(rendered)
    assert set(groups) == {"cpu", "user-code", "gpu"}
    assert gpus(groups["cpu"]) == 0 and gpus(groups["user-code"]) == 0
    assert gpus(groups["gpu"]) == 4
    gpu_container = ray_container(groups["gpu"]["template"])
    assert gpu_container["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert gpu_container["image"].endswith("-cuda")
    assert ray_container(groups["cpu"]["template"])["image"].endswith("-cpu")
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in groups["gpu"][
        "template"
    ]["spec"]["tolerations"]
    assert groups["cpu"]["minReplicas"] < groups["cpu"]["maxReplicas"]
    head = rendered.one("RayCluster")["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    # SQLite in the data dir: no DATABASE_URL at all.
    assert "DATABASE_URL" not in env_of(api_container(rendered))
    assert "DATABASE_URL" not in rendered.one("Secret")["data"]
    # Server settings left null keep the server's defaults: the chart renders none of them.
    assert set(configmap_data(rendered)) == {"OPD_DATA_DIR", "OPD_USER_CODE_RESOURCE", "HF_HOME"}
    assert configmap_data(rendered)["HF_HOME"] == "/data/huggingface"  # on the data volume
    assert rendered.one("PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "kubectl" in rendered.notes and "opd keys create --tenant" in rendered.notes


def _default_job_gpus() -> list[float]:
    """GPUs each actor of a job with the default `resources` reserves (`JobSpec` defaults on GPU)."""
    from opd_trainer.jobspec.job_spec import Resources

    resources = Resources()
    engines = [resources.student, resources.teacher]
    per_engine = [e.tensor_parallel_size * e.gpu_fraction for e in engines for _ in range(e.replicas)]
    return per_engine + [resources.learner_gpu_fraction] * resources.learner_gpus


def test_the_default_job_can_be_placed_on_the_default_chart(
    rendered_by_scenario: dict[str, Rendered],
) -> None:
    """Every actor of a default job fits a pod, and one pod holds the whole job (so `auto` weight
    transfer uses shared memory) — with the autoscaler's most pods, more than one such job."""
    group = worker_groups(rendered_by_scenario["default"])["gpu"]
    per_pod = gpus(group)
    job = _default_job_gpus()
    assert job == [1.0, 1.0, 1.0]
    assert max(job) <= per_pod and sum(job) <= per_pod
    assert group["maxReplicas"] * per_pod >= 2 * sum(job)
    memory = ray_container(group["template"])["resources"]["limits"]["memory"]
    shm = next(v for v in group["template"]["spec"]["volumes"] if v["name"] == "dshm")["emptyDir"]
    assert int(shm["sizeLimit"].removesuffix("Gi")) < int(memory.removesuffix("Gi"))


def test_helm_test_pod_asks_the_api_if_it_is_ready(rendered_by_scenario: dict[str, Rendered]) -> None:
    rendered = rendered_by_scenario["default"]
    pod = rendered.one("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    [container] = spec["containers"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    service = rendered.one("Service")
    url = f"http://{service['metadata']['name']}.{NAMESPACE}.svc:{service['spec']['ports'][0]['port']}/readyz"
    assert url in container["command"][-1]


def test_user_code_group_has_no_data_volume_and_no_secrets(rendered_by_scenario: dict[str, Rendered]) -> None:
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_custom_resources

    rendered = rendered_by_scenario["default"]
    groups = worker_groups(rendered)
    resource = configmap_data(rendered)["OPD_USER_CODE_RESOURCE"]
    for name, group in groups.items():
        spec = group["template"]["spec"]
        claims = [v for v in spec["volumes"] if "persistentVolumeClaim" in v or v["name"] == "data"]
        mounts = {m["mountPath"] for m in ray_container(group["template"]).get("volumeMounts", [])}
        # KubeRay's autoscaler reads the group's custom resources from this parameter (its own parser).
        advertised = _get_custom_resources({}, group.get("rayStartParams", {}), name)
        if name == "user-code":
            assert claims == [] and "/data" not in mounts
            assert advertised == {resource: 100000}
        else:
            assert claims and "/data" in mounts, name
            assert resource not in advertised, name
    # Ray pods get no secret at all: env entries are literal values, envFrom only the ConfigMap.
    for name, group in groups.items():
        container = ray_container(group["template"])
        assert all("valueFrom" not in entry for entry in container.get("env", [])), name
        assert [list(source) for source in container["envFrom"]] == [["configMapRef"]], name
    assert not {"OPD_ADMIN_KEY", "DATABASE_URL"} & set(configmap_data(rendered))


def test_training_groups_post_a_preemption_notice_before_they_go(
    rendered_by_scenario: dict[str, Rendered],
) -> None:
    """A drained training pod runs `opd preemption-notice` and stays its grace (jobs checkpoint); the
    user-code group, whose workers a pool replaces in place, has no hook."""
    groups = worker_groups(rendered_by_scenario["default"])
    for name, group in groups.items():
        spec, container = group["template"]["spec"], ray_container(group["template"])
        if name == "user-code":
            assert "lifecycle" not in container and "terminationGracePeriodSeconds" not in spec
            continue
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["opd", "preemption-notice"], name
        grace = float(command[command.index("--grace-s") + 1])
        assert spec["terminationGracePeriodSeconds"] == grace + 30, name


def test_cpu_only_install(rendered_by_scenario: dict[str, Rendered]) -> None:
    rendered = rendered_by_scenario["cpu-only"]
    groups = worker_groups(rendered)
    assert list(groups) == ["cpu", "user-code"]
    assert (groups["cpu"]["minReplicas"], groups["cpu"]["maxReplicas"]) == (1, 3)
    assert ray_container(groups["user-code"]["template"])["resources"]["limits"]["cpu"] == "2"
    for where, template in pod_templates(rendered):
        for container in template["spec"]["containers"]:
            assert "nvidia.com/gpu" not in json.dumps(container.get("resources", {})), where
            # The API pod runs the slim api image; every Ray pod the CPU one.
            assert container["image"].endswith("-cpu" if where.startswith("ray ") else "-api"), where
    claim = rendered.one("PersistentVolumeClaim")["spec"]
    assert claim["accessModes"] == ["ReadWriteOnce"] and claim["storageClassName"] == "standard"
    assert configmap_data(rendered)["OPD_MAX_CONCURRENT_JOBS"] == "1"


def test_two_gpu_groups_install(rendered_by_scenario: dict[str, Rendered]) -> None:
    rendered = rendered_by_scenario["two-gpu-groups"]
    groups = worker_groups(rendered)
    assert {name: gpus(group) for name, group in groups.items()} == {
        "cpu": 0,
        "user-code": 0,
        "gpu": 1,
        "teacher-tp4": 4,
    }
    teacher = groups["teacher-tp4"]
    spec = teacher["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {t.get("key") for t in spec["tolerations"]} == {"nvidia.com/gpu", "dedicated"}
    assert teacher["rayStartParams"]["object-store-memory"] == "34359738368"
    assert (teacher["minReplicas"], teacher["maxReplicas"]) == (0, 2)
    container = ray_container(teacher["template"])
    assert container["resources"]["limits"]["memory"] == "256Gi"
    assert env_of(container)["NCCL_DEBUG"]["value"] == "WARN"
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    for where, template in pod_templates(rendered):
        assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}], where
        assert ray_container(template)["image"].startswith("registry.example.com/ml/opd-trainer:"), where


def test_external_postgres_install(rendered_by_scenario: dict[str, Rendered]) -> None:
    rendered = rendered_by_scenario["external-postgres"]
    deployment = rendered.one("Deployment")["spec"]
    assert deployment["replicas"] == 2 and deployment["strategy"] == {"type": "RollingUpdate"}
    env = env_of(api_container(rendered))
    assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "opd-postgres", "key": "url"}
    assert env["OPD_ADMIN_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "opd-admin", "key": "admin-key"}
    assert rendered.of_kind("Secret") == []  # both come from existing Secrets
    ingress = rendered.one("Ingress")["spec"]
    assert ingress["ingressClassName"] == "nginx"
    backend = ingress["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": FULLNAME, "port": {"name": "http"}}
    monitor = rendered.one("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    # Per-job series are served only to the admin key: the scrape presents it from its Secret.
    assert monitor["spec"]["endpoints"][0]["bearerTokenSecret"] == {"name": "opd-admin", "key": "admin-key"}
    assert monitor["spec"]["selector"]["matchLabels"] == rendered.one("Service")["spec"]["selector"]
    data = configmap_data(rendered)
    # Whole numbers stay whole: YAML hands Helm floats, and 1e10 must not reach the server.
    assert data["OPD_MAX_UPLOAD_BYTES"] == "10737418240"
    assert data["OPD_MAX_CONCURRENT_JOBS"] == "8"
    assert data["OPD_LOG_LEVEL"] == "INFO"


def test_existing_ray_cluster_install(rendered_by_scenario: dict[str, Rendered]) -> None:
    rendered = rendered_by_scenario["existing-ray"]
    address = "ray://shared-ray-head-svc.ray-system.svc:10001"
    assert rendered.of_kind("RayCluster") == []
    # Not our cluster: no user-code group to require, processors go wherever that cluster has room.
    assert "OPD_USER_CODE_RESOURCE" not in configmap_data(rendered)
    assert env_of(api_container(rendered))["RAY_ADDRESS"]["value"] == address
    assert arg_after(api_container(rendered), "--ray-address") == address
    assert rendered.of_kind("PersistentVolumeClaim") == []
    volumes = rendered.one("Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "shared-opd-data"}} in volumes
    secret = rendered.one("Secret")
    assert set(secret["data"]) == {"OPD_ADMIN_KEY", "DATABASE_URL"}
    assert (
        env_of(api_container(rendered))["DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"]
        == (secret["metadata"]["name"])
    )
    assert address in rendered.notes


# -- values that must be refused -------------------------------------------------------------------


def test_wrong_types_are_rejected_by_the_values_schema(chart: helm.Chart) -> None:
    values = load_values("wrong-type.yaml")
    with pytest.raises(helm.HelmValuesError) as raised:
        chart.validate_schema(values)
    message = str(raised.value)
    for path in (
        "/api/replicaCount",
        "/ray/enableInTreeAutoscaling",
        "/ray/gpuWorkerGroups/gpu/gpusPerPod",
        "/persistence/accessModes",
    ):
        assert path in message, message
    # `helm template` and `helm lint` refuse the same file.
    with pytest.raises(helm.HelmValuesError):
        render(chart, values)
    report = helm.lint(CHART_DIR, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] and "/api/replicaCount" in "".join(report["errors"])


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"ray": {"enabled": False}}, "/ray/address"),
        ({"ray": {"enabled": False, "address": "10.0.0.1:6379"}}, "/ray/address"),
        ({"api": {"port": 70000}}, "/api/port"),
        ({"adminKey": {"value": "short"}}, "/adminKey/value"),
        ({"database": {"url": "mysql://db/opd"}}, "/database/url"),
        ({"api": {"service": {"type": "Internal"}}}, "/api/service/type"),
        ({"settings": {"extra": {"MAX_JOBS": "3"}}}, "'MAX_JOBS' does not match"),
        (
            {"settings": {"extra": {"OPD_ADMIN_KEY": "in-a-configmap"}}},
            "invalid propertyName 'OPD_ADMIN_KEY'",
        ),
        ({"ray": {"gpuWorkerGroups": {"Big_GPUs": {}}}}, "/ray/gpuWorkerGroups"),
        (
            {"ray": {"gpuWorkerGroups": {"big": {"enabled": True, "gpusPerPod": 8}}}},
            "/ray/gpuWorkerGroups/big",
        ),
        ({"ray": {"head": {"shmSize": 2}}}, "/ray/head/shmSize"),
        ({"ray": {"head": {"rayStartParams": {"num-cpus": 0}}}}, "/ray/head/rayStartParams/num-cpus"),
        ({"persistance": {"size": "1Gi"}}, "persistance"),
    ],
)
def test_schema_rejects(chart: helm.Chart, values: dict[str, Any], expected: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(expected)):
        chart.validate_schema(values)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"api": {"replicaCount": 2}}, "api.replicaCount > 1 needs PostgreSQL"),
        ({"ray": {"cpuWorkers": {"minReplicas": 4, "maxReplicas": 2}}}, "greater than maxReplicas"),
        ({"ray": {"gpuWorkerGroups": {"gpu": {"replicas": 5}}}}, "must lie between"),
        ({"ray": {"cpuWorkers": {"groupName": "gpu"}}}, "already used"),
        ({"ray": {"userCodeWorkers": {"groupName": "cpu"}}}, "already used"),
        (
            {"ray": {"userCodeWorkers": {"rayStartParams": {"resources": '"{}"'}}}},
            "ray.userCodeWorkers.rayStartParams.resources: the chart sets it",
        ),
    ],
)
def test_render_refuses_inconsistent_values(chart: helm.Chart, values: dict[str, Any], expected: str) -> None:
    """Cross-field rules JSON Schema cannot state fail the render with a message naming them."""
    with pytest.raises(helm.HelmRenderError, match=expected):
        render(chart, values)


def test_every_values_file_passes_the_schema(chart: helm.Chart) -> None:
    for path in sorted(VALUES_DIR.glob("*.yaml")):
        if path.name != "wrong-type.yaml":
            chart.validate_schema(load_values(path.name))


# -- values.yaml conventions ------------------------------------------------------------------------


def _documented(lines: list[str], line: int) -> bool:
    """Whether the comment block right above `line` (0-based) holds a `# --` doc comment."""
    above = line - 1
    while above >= 0 and lines[above].strip().startswith("#"):
        if lines[above].strip().startswith("# --"):
            return True
        above -= 1
    return False


def _any_documented(node: yaml.Node, lines: list[str]) -> bool:
    return isinstance(node, yaml.MappingNode) and any(
        _documented(lines, key.start_mark.line) or _any_documented(value, lines) for key, value in node.value
    )


def _undocumented(node: yaml.MappingNode, lines: list[str], path: str) -> Iterator[str]:
    """Keys with neither a `# --` comment nor documented keys below them (a section)."""
    for key, value in node.value:
        where = f"{path}.{key.value}" if path else key.value
        if _documented(lines, key.start_mark.line):
            continue
        if _any_documented(value, lines):
            yield from _undocumented(value, lines, where)
        else:
            yield where


def test_values_yaml_documents_every_field() -> None:
    """KubeRay's chart habit: each field carries a `# --` comment (helm-docs), `enabled:` flags only."""
    text = (CHART_DIR / "values.yaml").read_text()
    root = yaml.compose(text)
    assert isinstance(root, yaml.MappingNode)
    missing = list(_undocumented(root, text.splitlines(), ""))
    assert not missing, f"values without a '# --' comment: {missing}"
    assert not re.search(r"^\s*disabled:", text, re.MULTILINE)


def test_defaults_render_the_same_as_values_yaml(chart: helm.Chart, default_values: dict[str, Any]) -> None:
    """The chart's defaults are values.yaml alone: feeding it back changes nothing but the random key."""
    again = render(chart, copy.deepcopy(default_values))
    first = render(chart, None)

    def without_secret(rendered: Rendered) -> list[dict[str, Any]]:
        return [obj for obj in rendered.objects if obj["kind"] != "Secret"]

    assert without_secret(again) == without_secret(first)


def test_admin_key_is_generated_unless_given(chart: helm.Chart) -> None:
    """No value: a fresh 48-character key (an upgrade keeps the stored one through `lookup`, which
    sees no cluster here). A given value is stored as is."""
    generated = [
        base64.b64decode(render(chart, None).one("Secret")["data"]["OPD_ADMIN_KEY"]).decode()
        for _ in range(2)
    ]
    assert generated[0] != generated[1]
    assert all(len(key) == 48 and key.isalnum() for key in generated)
    given = render(chart, {"adminKey": {"value": "k" * 40}}).one("Secret")["data"]["OPD_ADMIN_KEY"]
    assert base64.b64decode(given).decode() == "k" * 40


def _documented_paths(node: yaml.MappingNode, lines: list[str], path: str) -> Iterator[str]:
    for key, value in node.value:
        name = "<name>" if path == "ray.gpuWorkerGroups" else key.value
        where = f"{path}.{name}" if path else name
        if _documented(lines, key.start_mark.line):
            yield where
        elif isinstance(value, yaml.MappingNode):
            yield from _documented_paths(value, lines, where)


def test_deploy_docs_list_every_value() -> None:
    """docs/deploy.md's values table names every documented field of values.yaml."""
    text = (CHART_DIR / "values.yaml").read_text()
    root = yaml.compose(text)
    assert isinstance(root, yaml.MappingNode)
    docs = (CHART_DIR.parents[1] / "docs" / "deploy.md").read_text()
    missing = [path for path in _documented_paths(root, text.splitlines(), "") if f"| `{path}` |" not in docs]
    assert not missing, f"add to the values table in docs/deploy.md: {missing}"


def test_names_used_in_the_docs(chart: helm.Chart) -> None:
    """docs/deploy.md installs release `opd-trainer` and refers to its objects by these names."""
    manifests = chart.render(None, name="opd-trainer", namespace="opd", is_install=True)
    objects = [
        doc
        for path, text in manifests.items()
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    names = {(obj["kind"], obj["metadata"]["name"]) for obj in objects}
    for expected in [
        ("Deployment", "opd-trainer"),
        ("Service", "opd-trainer"),
        ("Secret", "opd-trainer-secrets"),
        ("RayCluster", "opd-trainer"),
    ]:
        assert expected in names, names
    cpu_group = next(obj for obj in objects if obj["kind"] == "RayCluster")["spec"]["workerGroupSpecs"][0]
    assert cpu_group["groupName"] == "cpu"  # the docs' `-l ray.io/group=cpu`
