"""The deployment files validate with the tools their users run: hadolint for the
Dockerfile, podman-compose for every compose profile, helm lint/template for every
chart overlay and kubernetes-validate --strict for what it renders."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.tools import ensure_helm, ensure_podman, venv_tool

DEPLOY = Path(__file__).parents[2] / "deploy"
CHART = DEPLOY / "helm" / "tandem"
COMPOSE = DEPLOY / "docker-compose.yml"
SPLIT = {"api-server", "engine-core", "prefill-worker", "decode-worker"}
PROFILES = {
    "": {"tandem"},  # deploy/.env: unified by default
    "split": SPLIT,
    "split-tcp": {f"{s}-tcp" for s in SPLIT},
    "monitoring": {"prometheus", "grafana"},
    "fleet": {"replica-1", "replica-2", "router"},
    "xpyd": {"prefill-1", "decode-1", "decode-2", "router-xpyd"},
}


def run(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=120)
    assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_hadolint_passes_the_dockerfile() -> None:
    run(venv_tool("hadolint"), str(DEPLOY / "Dockerfile"))


@pytest.mark.parametrize("profile", list(PROFILES))
def test_each_compose_profile_validates(profile: str) -> None:
    ensure_podman()
    env = {k: v for k, v in os.environ.items() if k != "COMPOSE_PROFILES"}
    if profile:
        env["COMPOSE_PROFILES"] = profile
    compose = [venv_tool("podman-compose"), "-f", COMPOSE.name]
    run(*compose, "config", "-q", env=env, cwd=DEPLOY)
    services = run(*compose, "config", "--services", env=env, cwd=DEPLOY).split()
    assert set(services) == PROFILES[profile]


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


@pytest.mark.parametrize("suffix", ["", "-tcp"])
def test_split_services_share_one_loopback_and_agree_on_addresses(suffix: str) -> None:
    services = compose()["services"]
    api = services[f"api-server{suffix}"]
    env = api["environment"]
    for name in ("engine-core", "prefill-worker", "decode-worker"):
        service = services[name + suffix]
        assert service["network_mode"] == f"service:api-server{suffix}"
        # Docker shares /dev/shm by `ipc`; podman by the pod (x-podman: --share=ipc,net).
        assert service.get("ipc") == ("service:api-server" if not suffix else None)
        own = service["environment"]
        assert {k: own[k] for k in env} == env  # the same engine and pool addresses
    for pool in ("prefill", "decode"):
        worker = services[f"{pool}-worker{suffix}"]["environment"]
        assert worker["TANDEM_POOL"] == pool
        assert worker["TANDEM_WORKER_ADDRESS"] == env[f"TANDEM_{pool.upper()}_POOL_ADDRESS"]
    assert env["TANDEM_KV_TRANSFER"] == ("shm" if not suffix else "tcp")
    addresses = [v for k, v in env.items() if k.endswith("_ADDRESS")]
    assert addresses and all(a.startswith("tcp://127.0.0.1:") for a in addresses)
    assert "--share=ipc,net" in compose()["x-podman"]["pod_args"]


def test_prometheus_scrapes_every_deployment_that_serves_http() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    targets = {t for group in job["static_configs"] for t in group["targets"]}
    services = compose()["services"]
    tandem = {n: s for n, s in services.items() if "vllm-router" not in str(s.get("entrypoint"))}
    serving = {f"{name}:8000" for name, s in tandem.items() if ":8000" in str(s.get("ports"))}
    behind_router = ("fleet", "xpyd")
    serving |= {
        f"{name}:8000"
        for name, s in tandem.items()
        if set(s.get("profiles", [])) & set(behind_router)
    }
    assert targets == serving


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus() -> None:
    services = compose()["services"]
    mounts = " ".join(services["grafana"]["volumes"])
    assert "./grafana/tandem.json:/var/lib/grafana/dashboards/tandem.json" in mounts
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/tandem.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    for name in ("prometheus", "grafana"):  # pinned, never :latest
        image = services[name]["image"]
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest")


OVERLAYS = {
    "unified": [],
    "split": ["values-split.yaml"],
    "decode+prefill": ["values-decode.yaml", "values-prefill.yaml"],
    "decode": ["values-decode.yaml"],
    "prefill": ["values-prefill.yaml"],
    "fleet": ["values-fleet.yaml"],
    "xpyd": ["values-xpyd.yaml"],
    "inferencepool": ["values-inferencepool.yaml"],
}
EVERYTHING = [
    "apiKeys.keys={key-one-0001,key-two-0002}",
    "autoscaling.enabled=true",
    "gpu.enabled=true",
    "serviceMonitor.enabled=true",
    "curveKeys.existingSecret=tandem-curve",
]


def render(files: list[str], sets: list[str]) -> list[dict[str, Any]]:
    argv = [ensure_helm(), "template", "t", str(CHART)]
    for f in files:
        argv += ["-f", str(CHART / f)]
    for s in sets:
        argv += ["--set", s]
    return [doc for doc in yaml.safe_load_all(run(*argv)) if doc]


@pytest.mark.parametrize("overlay", list(OVERLAYS))
@pytest.mark.parametrize("extras", [[], EVERYTHING], ids=["defaults", "everything"])
def test_chart_lints_renders_and_validates(overlay: str, extras: list[str], tmp_path: Path) -> None:
    files = OVERLAYS[overlay]
    sets = extras or (
        ["curveKeys.existingSecret=k"]
        if "prefill" in overlay or "decode" in overlay or overlay == "xpyd"
        else []
    )
    lint = [ensure_helm(), "lint", "--strict", str(CHART)]
    for f in files:
        lint += ["-f", str(CHART / f)]
    for s in sets:
        lint += ["--set", s]
    run(*lint)
    docs = render(files, sets)
    kinds = [d["kind"] for d in docs]
    deployments = {"decode+prefill": 2, "fleet": 2, "xpyd": 3}  # xpyd: prefill, decode, router
    assert kinds.count("Deployment") == deployments.get(overlay, 1)
    # ServiceMonitor (Prometheus Operator) and InferencePool (Gateway API Inference
    # Extension) are CRDs: not in the core schemas (check_inference_pool reads it).
    core = [d for d in docs if d["kind"] not in ("ServiceMonitor", "InferencePool")]
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(core))
    run(venv_tool("kubernetes-validate"), "--strict", str(manifest))
    if extras:
        assert "ServiceMonitor" in kinds and "Secret" in kinds
        scaled = ("unified", "split", "fleet", "inferencepool")
        assert kinds.count("HorizontalPodAutoscaler") == (
            2 if overlay == "xpyd" else int(overlay in scaled)
        )
    (config,) = (d for d in docs if d["kind"] == "ConfigMap")
    gpu = "gpu.enabled=true" in extras
    if overlay == "split":  # GPU workers cannot share KV through /dev/shm: loopback TCP
        assert config["data"]["TANDEM_KV_TRANSFER"] == ("tcp" if gpu else "shm")
    routers = [
        d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "router"
    ]
    assert bool(routers) == (overlay in ("fleet", "xpyd"))
    if overlay == "fleet":
        check_router(routers, config, docs)
    if overlay == "xpyd":
        check_xpyd(routers, config, docs)
    assert ("InferencePool" in kinds) == (overlay == "inferencepool")
    if overlay == "inferencepool":
        check_inference_pool(docs)
    for deployment in (d for d in docs if d["kind"] == "Deployment" and d not in routers):
        shutdown_s = int(config["data"]["TANDEM_SHUTDOWN_TIMEOUT"])
        check_pod(deployment["spec"]["template"]["spec"], gpu, shutdown_s)


def check_pod(pod: dict[str, Any], gpu: bool, shutdown_s: int) -> None:
    """What every Tandem pod must have, whichever overlay made it."""
    assert pod["securityContext"]["runAsNonRoot"] is True
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    for c in pod["containers"]:
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
        assert ("nvidia.com/gpu" in c["resources"].get("limits", {})) == (
            gpu and ("worker" in c["name"] or c["name"] == "tandem")
        )
    serving = [c for c in pod["containers"] if "readinessProbe" in c]
    if serving:
        (api,) = serving
        assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert api["livenessProbe"]["httpGet"]["path"] == "/livez"
        assert api["startupProbe"]["httpGet"]["path"] == "/readyz"  # the model is loaded
        pause = api["lifecycle"]["preStop"]["exec"]["command"]  # leave the Service first
        assert pause[0] == "sleep"
        assert pod["terminationGracePeriodSeconds"] >= int(pause[1]) + shutdown_s


def check_router(
    routers: list[dict[str, Any]], config: dict[str, Any], docs: list[dict[str, Any]]
) -> None:
    """The router finds this release's serving pods by discovery, may list pods (and
    nothing more), and the replicas publish the KV events its kv_aware policy reads."""
    kinds = sorted(d["kind"] for d in routers)
    assert kinds == [
        "Deployment",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    (deployment,) = (d for d in routers if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (role,) = (d for d in routers if d["kind"] == "Role")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert pod["serviceAccountName"] == role["metadata"]["name"]
    (router,) = pod["containers"]
    args = router["args"]
    assert "--service-discovery" in args and "--policy=kv_aware" in args
    selector = args[args.index("--selector") + 1 : args.index("--selector") + 4]
    (server,) = (d for d in docs if d["kind"] == "Deployment" and d not in routers)
    labels = server["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in (s.split("=", 1) for s in selector))
    events = json.loads(config["data"]["TANDEM_KV_EVENTS_CONFIG"])
    assert events["enable_kv_cache_events"] and events["endpoint"] == "tcp://*:5557"
    assert router["securityContext"]["allowPrivilegeEscalation"] is False


def check_xpyd(
    routers: list[dict[str, Any]], config: dict[str, Any], docs: list[dict[str, Any]]
) -> None:
    """Prefill and decode Deployments, each with its role's kv_transfer_config, the pod's
    own IP as the address other pods reach it at, its own HPA signal and PDB; the router
    in PD mode selects each role by label."""
    (router,) = (d for d in routers if d["kind"] == "Deployment")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--vllm-pd-disaggregation", "--kv-connector=nixl", "--service-discovery"} <= set(args)
    assert config["data"]["TANDEM_EXPOSE_ENGINE"] == "true"
    assert config["data"]["TANDEM_CURVE_KEYS"] == "/etc/tandem/curve"
    signals = {
        "prefill": "tandem_num_prompt_tokens_waiting",
        "decode": "tandem_num_requests_running",
    }
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        (deployment,) = (
            d
            for d in docs
            if d["kind"] == "Deployment"
            and d["metadata"]["labels"]["app.kubernetes.io/component"] == role
        )
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        selector = args[args.index(f"--{role}-selector") + 1 : args.index(f"--{role}-selector") + 4]
        assert all(labels[k] == v for k, v in (s.split("=", 1) for s in selector))
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        transfer = json.loads(env["TANDEM_KV_TRANSFER_CONFIG"]["value"])
        assert transfer["kv_role"] == kv_role and transfer["kv_ip"] == "0.0.0.0"
        assert (
            env["TANDEM_KV_TRANSFER_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        )
        name = deployment["metadata"]["name"]
        hpas = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
        for hpa in (h for h in hpas if h["spec"]["scaleTargetRef"]["name"] == name):
            assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == signals[role]
        pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
        assert any(p["spec"]["selector"]["matchLabels"].items() <= labels.items() for p in pdbs)
    assert not any(  # clients use the router's Service; no Service selects a role's pods
        d["kind"] == "Service" and d not in routers for d in docs
    )


def check_inference_pool(docs: list[dict[str, Any]]) -> None:
    (pool,) = (d for d in docs if d["kind"] == "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    (server,) = (d for d in docs if d["kind"] == "Deployment")
    labels = server["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9002}


def test_the_schema_refuses_a_bad_topology() -> None:
    done = subprocess.run(
        [ensure_helm(), "template", "t", str(CHART), "--set", "topology=sideways"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "topology" in done.stderr


def test_the_fleet_router_names_every_replica_and_each_publishes_kv_events() -> None:
    services = compose()["services"]
    command = services["router"]["command"]
    urls = command[command.index("--worker-urls") + 1 : command.index("--worker-urls") + 3]
    assert urls == ["http://replica-1:8000", "http://replica-2:8000"]
    assert "--policy=kv_aware" in command
    for name in ("replica-1", "replica-2"):
        events = json.loads(services[name]["environment"]["TANDEM_KV_EVENTS_CONFIG"])
        assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
        # a bind address: the router resolves it to the replica's host from its URL
        assert events["endpoint"].startswith("tcp://*:")
