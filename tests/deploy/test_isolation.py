"""What the chart gives untrusted code, and the pods around it, checked on the rendered objects: no
pod mounts a service-account token (the head's autoscaler alone gets one, where Ray reads it), the
user-code group's runtime class, security context, env and volumes, Ray's ports fixed on every Ray
pod, and every NetworkPolicy rule, as the connections the policies allow or refuse between the
chart's pods, the cluster DNS, another namespace and addresses outside the cluster.

The connection checks evaluate the rendered policies with NetworkPolicy's own semantics (`allowed`):
a pod that some policy selects for a direction gets only what those policies allow, a connection
needs the sender's egress and the receiver's ingress, and an `ipBlock` is taken to match pod
addresses too (what a CNI may do), so that `except` has to keep the cluster's ranges out.

Run: `.venv/bin/pytest tests/deploy -q`.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import helm_python as helm
import pytest
from chart_rendering import (
    NAMESPACE,
    SCENARIOS,
    Rendered,
    env_of,
    pod_templates,
    ray_container,
    render,
    worker_groups,
)

USER_CODE = "user-code"


def merged(*layers: dict[str, Any]) -> dict[str, Any]:
    """Values layers merged like several `-f` files (later wins, maps merge)."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merged(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def pod_specs(rendered: Rendered) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every pod the release creates: API, Ray head and groups, the helm test."""
    for where, template in pod_templates(rendered):
        yield where, template["spec"]
    for pod in rendered.of_kind("Pod"):
        yield f"pod {pod['metadata']['name']}", pod["spec"]


def policy(rendered: Rendered, component: str) -> dict[str, Any]:
    [found] = [
        p
        for p in rendered.of_kind("NetworkPolicy")
        if p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component") == component
    ]
    return found


# -- service-account tokens -------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_no_pod_mounts_a_service_account_token(
    rendered_by_scenario: dict[str, Rendered], scenario: str
) -> None:
    """automountServiceAccountToken is off on every pod, and no volume projects a token, but the
    head's one for the autoscaler sidecar, which no container of the template mounts."""
    rendered = rendered_by_scenario[scenario]
    for where, spec in pod_specs(rendered):
        assert spec["automountServiceAccountToken"] is False, where
        for volume in spec.get("volumes", []):
            sources = volume.get("projected", {}).get("sources", [])
            if any("serviceAccountToken" in source for source in sources):
                assert (where, volume["name"]) == ("ray head", "autoscaler-token")
                for container in spec["containers"] + spec.get("initContainers", []):
                    assert all(m["name"] != volume["name"] for m in container.get("volumeMounts", []))


def test_the_autoscaler_alone_gets_a_token_where_ray_reads_it(
    chart: helm.Chart, rendered_by_scenario: dict[str, Rendered]
) -> None:
    from ray.autoscaler._private.kuberay.node_provider import IN_CLUSTER_CA_CERT_PATH, IN_CLUSTER_TOKEN_PATH

    cluster = rendered_by_scenario["default"].one("RayCluster")["spec"]
    [mount] = cluster["autoscalerOptions"]["volumeMounts"]
    assert mount["readOnly"] is True
    volumes = {v["name"]: v for v in cluster["headGroupSpec"]["template"]["spec"]["volumes"]}
    sources = volumes[mount["name"]]["projected"]["sources"]
    files = {
        os.path.join(mount["mountPath"], item["path"])
        for source in sources
        for item in ([source["serviceAccountToken"]] if "serviceAccountToken" in source else [])
        + source.get("configMap", {}).get("items", [])
    }
    assert files == {IN_CLUSTER_TOKEN_PATH, IN_CLUSTER_CA_CERT_PATH}
    # The chart's other autoscaler options are kept.
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] == 60
    # Without the autoscaler, nobody gets a token.
    manual = render(chart, {"ray": {"enableInTreeAutoscaling": False}}).one("RayCluster")["spec"]
    assert "autoscalerOptions" not in manual
    head_volumes = manual["headGroupSpec"]["template"]["spec"]["volumes"]
    assert "autoscaler-token" not in {v["name"] for v in head_volumes}


# -- Ray's token -------------------------------------------------------------------------------------


def test_the_cluster_requires_ray_token_and_the_api_presents_it(
    chart: helm.Chart, rendered_by_scenario: dict[str, Rendered]
) -> None:
    """KubeRay generates the token into a Secret named after the RayCluster (key `auth_token`) and
    puts it in every Ray container; the API container reads it from there, under the variables Ray
    itself reads: with them, Ray's own layer is in token mode and accepts that token and no other."""
    rendered = rendered_by_scenario["default"]
    cluster = rendered.one("RayCluster")
    assert cluster["spec"]["authOptions"] == {"mode": "token"}
    env = env_of(rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0])
    ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": cluster["metadata"]["name"], "key": "auth_token"}
    probe = (
        "import ray._raylet as r; "
        "print(r.get_authentication_mode() == r.AuthenticationMode.TOKEN, "
        "r.validate_authentication_token('Bearer t0ken-from-the-secret'), "
        "r.validate_authentication_token('Bearer another'))"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    ray_env = {"RAY_AUTH_MODE": env["RAY_AUTH_MODE"]["value"], "RAY_AUTH_TOKEN": "t0ken-from-the-secret"}
    answer = subprocess.run(
        [sys.executable, "-c", probe], env={**clean, **ray_env}, capture_output=True, text=True, check=True
    )
    assert answer.stdout.split() == ["True", "True", "False"]
    off = render(chart, {"ray": {"auth": {"enabled": False}}})
    assert "authOptions" not in off.one("RayCluster")["spec"]
    api_env = env_of(off.one("Deployment")["spec"]["template"]["spec"]["containers"][0])
    assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & set(api_env)
    # A cluster at ray.address is not ours: its token, if any, comes through api.extraEnv.
    existing = env_of(
        rendered_by_scenario["existing-ray"].one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    )
    assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & set(existing)


# -- the user-code group ------------------------------------------------------------------------------


def test_runtime_class_is_set_on_user_code_pods_when_given(
    chart: helm.Chart, rendered_by_scenario: dict[str, Rendered]
) -> None:
    for where, spec in pod_specs(rendered_by_scenario["default"]):
        assert "runtimeClassName" not in spec, where
    rendered = render(chart, {"ray": {"userCodeWorkers": {"runtimeClassName": "gvisor"}}})
    for where, spec in pod_specs(rendered):
        expected = "gvisor" if where == f"ray group {USER_CODE}" else None
        assert spec.get("runtimeClassName") == expected, where


def test_user_code_security_context_lets_bubblewrap_make_namespaces_and_nothing_more(
    chart: helm.Chart, rendered_by_scenario: dict[str, Rendered]
) -> None:
    groups = worker_groups(rendered_by_scenario["default"])
    template = groups[USER_CODE]["template"]
    security = ray_container(template)["securityContext"]
    assert security == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "Unconfined"},
        "appArmorProfile": {"type": "Unconfined"},
    }
    assert "hostUsers" not in template["spec"]
    # The other groups keep the common context under the pod's RuntimeDefault seccomp profile.
    for name in ("cpu", "gpu"):
        spec = groups[name]["template"]["spec"]
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert "seccompProfile" not in ray_container(groups[name]["template"])["securityContext"], name
    # userNamespace: the pod in a user namespace, with the unmasked /proc bubblewrap mounts anew.
    groups = worker_groups(render(chart, {"ray": {"userCodeWorkers": {"userNamespace": True}}}))
    template = groups[USER_CODE]["template"]
    assert template["spec"]["hostUsers"] is False
    assert ray_container(template)["securityContext"]["procMount"] == "Unmasked"
    for name in ("cpu", "gpu"):
        assert "hostUsers" not in groups[name]["template"]["spec"]
        assert "procMount" not in ray_container(groups[name]["template"])["securityContext"]


@pytest.mark.parametrize("scenario", [name for name in SCENARIOS if name != "existing-ray"])
def test_user_code_pods_mount_no_data_and_hold_no_secret(
    rendered_by_scenario: dict[str, Rendered], scenario: str
) -> None:
    rendered = rendered_by_scenario[scenario]
    template = worker_groups(rendered)[USER_CODE]["template"]
    spec = template["spec"]
    container = ray_container(template)
    for volume in spec["volumes"]:
        assert not {"persistentVolumeClaim", "secret", "projected"} & set(volume), volume
    data_dir = rendered.one("ConfigMap")["data"]["OPD_DATA_DIR"]
    assert all(not m["mountPath"].startswith(data_dir) for m in container["volumeMounts"])
    assert all("secretKeyRef" not in entry.get("valueFrom", {}) for entry in container.get("env", []))
    assert [list(source) for source in container["envFrom"]] == [["configMapRef"]]
    assert spec["enableServiceLinks"] is False


def test_a_secret_for_the_drivers_stays_off_user_code_pods(chart: helm.Chart) -> None:
    password = {"secretKeyRef": {"name": "mlflow", "key": "pw"}}
    secret = {"name": "MLFLOW_TRACKING_PASSWORD", "valueFrom": password}
    groups = worker_groups(render(chart, {"ray": {"cpuWorkers": {"containerEnv": [secret]}}}))
    assert env_of(ray_container(groups["cpu"]["template"]))["MLFLOW_TRACKING_PASSWORD"] == secret
    assert "MLFLOW_TRACKING_PASSWORD" not in env_of(ray_container(groups[USER_CODE]["template"]))


_SECRET_ENV = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
_DATA_CLAIM = {"name": "d", "persistentVolumeClaim": {"claimName": "opd-opd-trainer-data"}}


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"ray": {"common": {"containerEnv": _SECRET_ENV}}}, "env TOKEN takes a Secret"),
        ({"ray": {"userCodeWorkers": {"containerEnv": _SECRET_ENV}}}, "env TOKEN takes a Secret"),
        (
            {"ray": {"userCodeWorkers": {"volumes": [{"name": "creds", "secret": {"secretName": "s"}}]}}},
            "ray.userCodeWorkers.volumes: creds",
        ),
        (
            {"ray": {"userCodeWorkers": {"volumes": [{"name": "tok", "projected": {"sources": []}}]}}},
            "ray.userCodeWorkers.volumes: tok",
        ),
        ({"ray": {"userCodeWorkers": {"volumes": [_DATA_CLAIM]}}}, "ray.userCodeWorkers.volumes: d"),
        (
            {"ray": {"userCodeWorkers": {"securityContext": {"privileged": True}}}},
            "user-code pods never run privileged",
        ),
        (
            {"ray": {"cpuWorkers": {"rayStartParams": {"node-manager-port": "9999"}}}},
            "worker group cpu: rayStartParams.node-manager-port: the chart sets Ray's ports",
        ),
        (
            {"ray": {"head": {"rayStartParams": {"num-cpus": "0", "port": "7000"}}}},
            "ray.head: rayStartParams.port: the chart sets Ray's ports",
        ),
        (
            {"ray": {"gpuWorkerGroups": {"gpu": {"rayStartParams": {"worker-port-list": "10002"}}}}},
            "worker group gpu: rayStartParams.worker-port-list",
        ),
        (
            {"ray": {"common": {"ports": {"minWorker": 20000, "maxWorker": 10002}}}},
            "minWorker (20000) is greater than maxWorker",
        ),
        (
            {"ray": {"common": {"ports": {"nodeManager": 12000}}}},
            "the nodeManager port 12000 lies in the worker port range",
        ),
        (
            {"ray": {"common": {"ports": {"objectManager": 8077}}}},
            "ports are both 8077",
        ),
        (
            {"ray": {"networkPolicy": {"gatewayPorts": {"start": 40000, "end": 30000}}}},
            "gatewayPorts: start (40000) is greater than end",
        ),
        (
            {"ray": {"userCodeWorkers": {"labels": {"app.kubernetes.io/component": "ray-worker"}}}},
            "app.kubernetes.io/component is the chart's",
        ),
        ({"common": {"labels": {"app.kubernetes.io/component": "x"}}}, "common.labels"),
    ],
)
def test_render_refuses_what_would_open_the_boundary(
    chart: helm.Chart, values: dict[str, Any], expected: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(expected)):
        render(chart, values)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"ray": {"networkPolicy": {"userCode": {"allowInternet": "yes"}}}}, "/ray/networkPolicy/userCode"),
        ({"ray": {"networkPolicy": {"userCode": {"internetExcept": ["10/8"]}}}}, "internetExcept"),
        ({"ray": {"common": {"ports": {"nodeManager": 70000}}}}, "/ray/common/ports/nodeManager"),
        ({"ray": {"userCodeWorkers": {"runtimeClassName": 1}}}, "/ray/userCodeWorkers/runtimeClassName"),
        ({"api": {"networkPolicy": {"database": {"port": "pg"}}}}, "/api/networkPolicy/database/port"),
        ({"ray": {"networkPolicy": {"extraIngress": []}}}, "extraIngress"),  # now under head/workers
    ],
)
def test_schema_rejects_isolation_values(chart: helm.Chart, values: dict[str, Any], expected: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(expected)):
        chart.validate_schema(values)


# -- Ray's ports ---------------------------------------------------------------------------------------


# `ray.scripts.scripts` imports Ray Serve's config models, which warn about pydantic v1 idioms.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_every_ray_pod_binds_the_ports_the_policies_name(
    rendered_by_scenario: dict[str, Rendered], default_values: dict[str, Any]
) -> None:
    """The chart passes ray.common.ports to `ray start` on the head and every group, as flags
    `ray start` has (KubeRay turns each key into `--key=value`)."""
    from ray.scripts.scripts import start

    flags = {option for param in start.params for option in param.opts}
    ports = default_values["ray"]["common"]["ports"]
    expected = {
        "node-manager-port": ports["nodeManager"],
        "object-manager-port": ports["objectManager"],
        "dashboard-agent-grpc-port": ports["dashboardAgentGrpc"],
        "dashboard-agent-listen-port": ports["dashboardAgentListen"],
        "metrics-export-port": ports["metricsExport"],
        "min-worker-port": ports["minWorker"],
        "max-worker-port": ports["maxWorker"],
    }
    assert {f"--{key}" for key in expected} <= flags
    cluster = rendered_by_scenario["default"].one("RayCluster")["spec"]
    groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
    assert len(groups) == 4
    for name, group in groups:
        params = group["rayStartParams"]
        assert {key: params.get(key) for key in expected} == {k: str(v) for k, v in expected.items()}, name
        metrics = next(p for p in ray_container(group["template"])["ports"] if p["name"] == "metrics")
        assert metrics["containerPort"] == ports["metricsExport"], name


# -- NetworkPolicies as connections ----------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """One end of a connection: a pod (namespace and labels; pods have cluster addresses too) or a
    bare address outside the cluster (no namespace)."""

    ip: str
    namespace: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace} if self.namespace else {}


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        ok = {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels.get(key) not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[operator]
        if not ok:
            return False
    return True


def peer_matches(peer: Mapping[str, Any], other: Endpoint, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        address = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        inside = address in ipaddress.ip_network(block["cidr"])
        return inside and not any(address in ipaddress.ip_network(cidr) for cidr in block.get("except", []))
    if other.namespace is None:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], other.namespace_labels):
            return False
    elif other.namespace != policy_namespace:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], other.labels)


def port_matches(entries: list[dict[str, Any]] | None, port: int, protocol: str) -> bool:
    if not entries:
        return True
    for entry in entries:
        assert isinstance(entry.get("port", 0), int), "the chart names ports by number"
        if entry.get("protocol", "TCP") != protocol:
            continue
        if "port" not in entry or entry["port"] <= port <= entry.get("endPort", entry["port"]):
            return True
    return False


def direction_allows(
    policies: list[dict[str, Any]], pod: Endpoint, other: Endpoint, port: int, protocol: str, kind: str
) -> bool:
    """Whether `pod`'s policies of one direction ("Ingress": `other` connects to `pod`, "Egress":
    `pod` connects to `other`) let the connection through."""
    if pod.namespace is None:
        return True  # outside the cluster: no NetworkPolicy applies
    mine = [
        p
        for p in policies
        if p["metadata"]["namespace"] == pod.namespace
        and selects(p["spec"]["podSelector"], pod.labels)
        and kind in p["spec"]["policyTypes"]
    ]
    if not mine:
        return True
    peers_key, rules_key = ("from", "ingress") if kind == "Ingress" else ("to", "egress")
    for p in mine:
        for rule in p["spec"].get(rules_key, []):
            peers = rule.get(peers_key)
            if peers and not any(peer_matches(peer, other, pod.namespace) for peer in peers):
                continue
            if port_matches(rule.get("ports"), port, protocol):
                return True
    return False


def allowed(rendered: Rendered, source: Endpoint, target: Endpoint, port: int, protocol: str = "TCP") -> bool:
    policies = rendered.of_kind("NetworkPolicy")
    return direction_allows(policies, source, target, port, protocol, "Egress") and direction_allows(
        policies, target, source, port, protocol, "Ingress"
    )


def endpoints(rendered: Rendered) -> dict[str, Endpoint]:
    """The release's pods (by role, with the labels their templates render) and the world around them."""
    found = {
        "kube-dns": Endpoint("10.8.9.9", "kube-system", {"k8s-app": "kube-dns"}),
        "other-namespace": Endpoint("10.8.7.7", "team-b", {"app": "web"}),
        "ingress-controller": Endpoint("10.8.6.6", "ingress-nginx", {"app": "ingress-nginx"}),
        "pypi-mirror": Endpoint("10.8.5.5", "pypi", {"app": "devpi"}),
        "internet": Endpoint("93.184.216.34"),
        "metadata": Endpoint("169.254.169.254"),
        "postgres": Endpoint("10.20.0.5"),
        "another-host": Endpoint("10.20.0.6"),
    }
    pods = {"api": rendered.one("Deployment")["spec"]["template"]["metadata"]["labels"]}
    pods["helm-test"] = rendered.one("Pod")["metadata"]["labels"]
    for cluster in rendered.of_kind("RayCluster"):
        pods["head"] = cluster["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
        for group in cluster["spec"]["workerGroupSpecs"]:
            pods[group["groupName"]] = group["template"]["metadata"]["labels"]
    for index, (name, labels) in enumerate(pods.items()):
        found[name] = Endpoint(f"10.8.0.{index + 1}", NAMESPACE, labels)
    return found


def check(rendered: Rendered, expectations: list[tuple[str, str, int | str, bool]]) -> None:
    """Each (source, target, port or 'PORT/UDP', allowed) against the rendered policies."""
    where = endpoints(rendered)
    wrong = []
    for source, target, port, expected in expectations:
        number, _, protocol = str(port).partition("/")
        if allowed(rendered, where[source], where[target], int(number), protocol or "TCP") != expected:
            wrong.append(f"{source} -> {target}:{port} should be {'allowed' if expected else 'refused'}")
    assert not wrong, "\n".join(wrong)


def test_default_policies_as_connections(rendered_by_scenario: dict[str, Rendered]) -> None:
    check(
        rendered_by_scenario["default"],
        [
            # The user-code pods' trusted Ray worker: the GCS, Ray's ports, the gateways, DNS.
            ("user-code", "head", 6379, True),
            ("user-code", "head", 8077, True),
            ("user-code", "head", 8076, True),
            ("user-code", "head", 10002, True),
            ("user-code", "head", 19999, True),
            ("user-code", "head", 10001, False),  # Ray Client
            ("user-code", "head", 8265, False),  # dashboard
            ("user-code", "head", 52365, False),  # the head's dashboard agent
            ("user-code", "cpu", 8077, True),
            ("user-code", "cpu", 10500, True),
            ("user-code", "cpu", 20000, False),
            ("user-code", "cpu", 32768, True),  # a gateway
            ("user-code", "cpu", 60999, True),
            ("user-code", "gpu", 45000, True),
            ("user-code", "cpu", 61000, False),
            ("user-code", "cpu", 29500, False),  # torch.distributed's default port
            ("user-code", "cpu", 8080, False),  # metrics
            ("user-code", "user-code", 8076, True),  # objects from another user-code pod
            ("user-code", "kube-dns", "53/UDP", True),
            ("user-code", "kube-dns", 53, True),
            ("user-code", "kube-dns", 8080, False),
            ("user-code", "api", 8000, False),
            ("user-code", "internet", 443, False),
            ("user-code", "metadata", 80, False),
            ("user-code", "other-namespace", 80, False),
            ("user-code", "pypi-mirror", 8080, False),
            # Into user-code pods: Ray's ports from Ray pods, the agent from the head only.
            ("head", "user-code", 8077, True),
            ("head", "user-code", 52365, True),
            ("head", "user-code", 8079, True),
            ("cpu", "user-code", 10005, True),
            ("gpu", "user-code", 8076, True),
            ("cpu", "user-code", 52365, False),
            ("cpu", "user-code", 8080, False),
            ("api", "user-code", 8077, False),
            ("other-namespace", "user-code", 8077, False),
            # CPU and GPU workers: everything among themselves and from the head, nothing from outside.
            ("head", "cpu", 29500, True),
            ("cpu", "gpu", 29500, True),
            ("gpu", "cpu", "40000/UDP", True),
            ("other-namespace", "cpu", 8077, False),
            ("other-namespace", "gpu", 10002, False),
            ("api", "cpu", 10002, False),
            ("cpu", "internet", 443, True),  # trusted code: trackers, object stores, hubs
            # The head: Ray Client from the API only, the dashboard from no pod.
            ("api", "head", 10001, True),
            ("cpu", "head", 10001, False),
            ("other-namespace", "head", 10001, False),
            ("cpu", "head", 8265, False),
            ("api", "head", 8265, False),
            ("cpu", "head", 6379, True),
            ("gpu", "head", 23000, True),
            ("other-namespace", "head", 6379, False),
            # The API pod: its port from anywhere; out only to Ray Client and DNS.
            ("internet", "api", 8000, True),
            ("other-namespace", "api", 8000, True),
            ("helm-test", "api", 8000, True),
            ("other-namespace", "api", 9000, False),
            ("api", "head", 6379, False),
            ("api", "kube-dns", "53/UDP", True),
            ("api", "internet", 443, False),
            ("api", "postgres", 5432, False),  # SQLite: no database rule
            ("api", "metadata", 80, False),
        ],
    )


def test_allow_internet_opens_the_internet_and_nothing_inside(chart: helm.Chart) -> None:
    rendered = render(chart, {"ray": {"networkPolicy": {"userCode": {"allowInternet": True}}}})
    check(
        rendered,
        [
            ("user-code", "internet", 443, True),
            ("user-code", "internet", 80, True),
            ("user-code", "metadata", 80, False),
            ("user-code", "api", 8000, False),  # the API takes any source, but not through this rule
            ("user-code", "other-namespace", 80, False),
            ("user-code", "postgres", 5432, False),
            ("user-code", "cpu", 29500, False),
            ("user-code", "head", 10001, False),
        ],
    )


def test_user_code_egress_is_exactly_the_allowed_rules(
    chart: helm.Chart, rendered_by_scenario: dict[str, Rendered], default_values: dict[str, Any]
) -> None:
    ports = default_values["ray"]["common"]["ports"]
    gateways = default_values["ray"]["networkPolicy"]["gatewayPorts"]
    dns = default_values["common"]["dns"]

    def pods(*components: str) -> dict[str, Any]:
        return {"podSelector": {"components": sorted(components)}}

    def normalized(rule: dict[str, Any]) -> dict[str, Any]:
        peers = []
        for peer in rule.get("to", []):
            selector = peer.get("podSelector", {})
            if "namespaceSelector" not in peer and "ipBlock" not in peer:
                assert selector["matchLabels"]["app.kubernetes.io/instance"] == "opd"
                component = selector["matchLabels"].get("app.kubernetes.io/component")
                values = [component] if component else selector["matchExpressions"][0]["values"]
                peer = pods(*values)
            peers.append(peer)
        return {"to": peers, "ports": rule.get("ports")}

    def tcp(*spans: tuple[int, int]) -> list[dict[str, Any]]:
        return [
            {"protocol": "TCP", "port": a} if a == b else {"protocol": "TCP", "port": a, "endPort": b}
            for a, b in spans
        ]

    ray_ports = tcp(
        (ports["nodeManager"],) * 2, (ports["objectManager"],) * 2, (ports["minWorker"], ports["maxWorker"])
    )
    expected = [
        {"to": [pods("ray-head")], "ports": tcp((6379, 6379))},
        {"to": [pods("ray-head", "ray-worker", "ray-user-code")], "ports": ray_ports},
        {"to": [pods("ray-worker")], "ports": tcp((gateways["start"], gateways["end"]))},
        {"to": dns["to"], "ports": dns["ports"]},
    ]
    egress = policy(rendered_by_scenario["default"], "ray-user-code")["spec"]["egress"]
    assert [normalized(rule) for rule in egress] == expected
    assert "0.0.0.0/0" not in json.dumps(egress)
    opened = render(chart, {"ray": {"networkPolicy": {"userCode": {"allowInternet": True}}}})
    egress = policy(opened, "ray-user-code")["spec"]["egress"]
    except_ = default_values["ray"]["networkPolicy"]["userCode"]["internetExcept"]
    internet = {"ipBlock": {"cidr": "0.0.0.0/0", "except": except_}}
    assert [normalized(rule) for rule in egress] == [*expected, {"to": [internet], "ports": None}]


def test_api_ingress_from_given_peers_only(chart: helm.Chart) -> None:
    nginx = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    rendered = render(chart, {"api": {"networkPolicy": {"ingressFrom": [nginx]}}})
    check(
        rendered,
        [
            ("ingress-controller", "api", 8000, True),
            ("helm-test", "api", 8000, True),
            ("other-namespace", "api", 8000, False),
            ("internet", "api", 8000, False),
        ],
    )


def test_api_egress_reaches_the_database_and_an_existing_ray_cluster(
    chart: helm.Chart, rendered_by_scenario: dict[str, Rendered]
) -> None:
    check(
        rendered_by_scenario["external-postgres"],
        [("api", "postgres", 5432, True), ("api", "postgres", 5433, False), ("api", "internet", 443, False)],
    )
    pinned = render(
        chart,
        {
            "database": {"existingSecret": "pg"},
            "api": {"networkPolicy": {"database": {"to": [{"ipBlock": {"cidr": "10.20.0.5/32"}}]}}},
        },
    )
    check(pinned, [("api", "postgres", 5432, True), ("api", "another-host", 5432, False)])
    existing = rendered_by_scenario["existing-ray"]
    assert [p["metadata"]["name"] for p in existing.of_kind("NetworkPolicy")] == ["opd-opd-trainer-api"]
    # ray://shared-ray-head-svc.ray-system.svc:10001 and its database, wherever they run.
    check(existing, [("api", "another-host", 10001, True), ("api", "another-host", 6379, False)])
    check(existing, [("api", "postgres", 5432, True)])


def test_untrusted_code_install(rendered_by_scenario: dict[str, Rendered]) -> None:
    """tests/deploy/values/untrusted-code.yaml: gVisor, a user namespace, own nodes, the internet."""
    rendered = rendered_by_scenario["untrusted-code"]
    spec = worker_groups(rendered)[USER_CODE]["template"]["spec"]
    assert (spec["runtimeClassName"], spec["hostUsers"]) == ("gvisor", False)
    assert spec["nodeSelector"] == {"sandbox.gke.io/runtime": "gvisor"}
    assert spec["tolerations"][0]["key"] == "sandbox.gke.io/runtime"
    check(
        rendered,
        [
            ("user-code", "internet", 443, True),
            ("user-code", "metadata", 80, False),
            ("user-code", "api", 8000, False),
            ("ingress-controller", "api", 8000, True),
            ("internet", "api", 8000, False),
            ("other-namespace", "api", 8000, False),
            ("api", "postgres", 5432, True),
            ("api", "another-host", 5432, False),
        ],
    )


def test_extra_rules_reach_their_policies(chart: helm.Chart) -> None:
    mirror = {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "pypi"}},
                "podSelector": {"matchLabels": {"app": "devpi"}},
            }
        ],
        "ports": [{"protocol": "TCP", "port": 8080}],
    }
    scrape = {
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "team-b"}}}],
        "ports": [{"protocol": "TCP", "port": 8080}],
    }
    values = {
        "ray": {
            "networkPolicy": {
                "head": {"extraIngress": [scrape]},
                "workers": {"extraIngress": [scrape]},
                "userCode": {"extraEgress": [mirror], "extraIngress": [scrape]},
            }
        },
        "api": {"networkPolicy": {"extraEgress": [mirror]}},
    }
    rendered = render(chart, values)
    check(
        rendered,
        [
            ("user-code", "pypi-mirror", 8080, True),
            ("api", "pypi-mirror", 8080, True),
            ("other-namespace", "head", 8080, True),
            ("other-namespace", "cpu", 8080, True),
            ("other-namespace", "user-code", 8080, True),
            ("other-namespace", "user-code", 8077, False),
        ],
    )
    off = {"ray": {"networkPolicy": {"enabled": False}}, "api": {"networkPolicy": {"enabled": False}}}
    assert render(chart, merged(values, off)).of_kind("NetworkPolicy") == []
