"""Run the Kubernetes manifests' containers with podman, as a kubelet would, and check
that the deployment comes up: broker, worker and gateway (init containers first), from
the rendered objects of one overlay (their image, command, args, env, user, read-only
root, Secret files with the modes Kubernetes gives them, emptyDirs), in one podman pod
whose only network is its loopback (the broker Service's name is replaced by 127.0.0.1).  Then: the
worker's exec readiness probe passes, the gateway's /health answers 200 and a generate
returns tokens; the worker's kernels came from the image (no compile at start); and after
the broker stops, the worker's probe fails.

    python deploy/container/pod_smoke.py --image localhost/tokserve:cpu [--podman 'podman --storage-driver vfs ...']

Needs podman, kubectl (to render) and a built image; not part of CI (docs/deployment.md, "Container
image" says what it showed and where).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
UID = 10001
PROBE_GENERATE = (
    "import json, sys, urllib.request; "
    "body = json.dumps({'token_ids': [72, 101, 108, 108, 111], 'sampling_params': {'max_tokens': 8, 'temperature': 0}}); "
    "req = urllib.request.Request(f'http://127.0.0.1:{sys.argv[1]}/inference/v1/generate', body.encode(), "
    "{'Content-Type': 'application/json'}); "
    "print(json.load(urllib.request.urlopen(req, timeout=60))['choices'][0]['token_ids'])")
ROUTER_PORT = "8001"  # in Kubernetes the router is a pod of its own; here it shares the gateway's loopback
PROBE_HEALTH = ("import urllib.request, sys; "
                "sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}/health', timeout=5).status == 200 "
                "else 1)")


def render(overlay: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(REPO / "deploy/kubernetes/overlays" / overlay)],
                         check=True, capture_output=True, text=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def make_secrets(work: Path) -> dict[str, Path]:
    """make-secrets.sh's Secrets, written as a Secret volume holds them (0440, group 10001)."""
    env = dict(os.environ, TOKSERVE=f"{sys.executable} -m common.cli", PYTHONPATH=str(REPO))
    out = subprocess.run(["bash", str(REPO / "deploy/kubernetes/make-secrets.sh"), "tokserve"], check=True,
                         capture_output=True, text=True, env=env, cwd=REPO)
    import base64

    dirs = {}
    for doc in yaml.safe_load_all(out.stdout):
        d = work / "secrets" / doc["metadata"]["name"]
        d.mkdir(parents=True)
        for key, value in doc["data"].items():
            (d / key).write_bytes(base64.b64decode(value))
            os.chown(d / key, 0, UID)
            (d / key).chmod(0o440)
        dirs[doc["metadata"]["name"]] = d
    return dirs


class Pod:
    def __init__(self, podman: list[str], image: str, name: str, work: Path):
        self.podman, self.image, self.name, self.work = podman, image, name, work
        self.containers: list[str] = []

    def run(self, *args: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([*self.podman, *args], capture_output=capture, text=True)
        if check and out.returncode != 0:
            raise SystemExit(f"FAILED: podman {' '.join(args[:6])} ...: exit {out.returncode}\n{out.stderr}")
        return out

    def create(self) -> None:
        self.run("pod", "create", "--name", self.name, "--network", "none")

    def volumes(self, workload: dict, secrets: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
        """volume name -> (host path, read-only); emptyDirs are fresh 0777 folders."""
        out = {}
        for v in workload["spec"]["template"]["spec"].get("volumes", []):
            if "secret" in v:
                src = secrets[v["secret"]["secretName"]]
                d = self.work / "vol" / workload["metadata"]["name"] / v["name"]
                d.mkdir(parents=True)
                for item in v["secret"]["items"]:
                    shutil.copy2(src / item["key"], d / item["path"])
                    os.chown(d / item["path"], 0, UID)
                    (d / item["path"]).chmod(v["secret"]["defaultMode"])
                out[v["name"]] = (d, True)
            else:
                d = self.work / "vol" / workload["metadata"]["name"] / v["name"]
                d.mkdir(parents=True)
                d.chmod(0o777)
                out[v["name"]] = (d, False)
        return out

    def container_args(self, c: dict, volumes: dict, detach: bool, name: str, image: str) -> list[str]:
        args = ["run", "--pod", self.name, "--name", name, "--user", f"{UID}:{UID}", "--read-only",
                "--read-only-tmpfs=false", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                "--ulimit", "nofile=4096:20000", "--ulimit", "nproc=4096:4096"]
        args += ["-d"] if detach else ["--rm"]
        for m in c.get("volumeMounts", []):
            path, ro = volumes[m["name"]]
            args += ["-v", f"{path}:{m['mountPath']}{':ro' if ro or m.get('readOnly') else ''}"]
        env = {}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
            elif "fieldRef" in e.get("valueFrom", {}):
                env[e["name"]] = "0"  # the pod index of the first StatefulSet pod
            elif "resourceFieldRef" in e.get("valueFrom", {}):
                env[e["name"]] = "1"
        for k, v in env.items():
            args += ["-e", f"{k}={v}"]
        cmd = [self._expand(a, env) for a in c.get("args", [])]
        if c.get("command"):
            args += ["--entrypoint", c["command"][0]]
            cmd = [self._expand(a, env) for a in c["command"][1:]] + cmd
        return [*args, image, *cmd]

    @staticmethod
    def _expand(arg: str, env: dict) -> str:
        for k, v in env.items():
            arg = arg.replace(f"$({k})", v)
        # The pod's only network is its loopback, where the Services' ports listen.
        return arg.replace("tcp://tokserve-broker:", "tcp://127.0.0.1:").replace("http://tokserve-gateway:",
                                                                                 "http://127.0.0.1:")

    def start(self, workload: dict, secrets: dict[str, Path], image: str = "") -> str:
        spec = workload["spec"]["template"]["spec"]
        volumes = self.volumes(workload, secrets)
        role = workload["metadata"]["name"].removeprefix("tokserve-")
        for i, c in enumerate(spec.get("initContainers", [])):
            self.run(*self.container_args(c, volumes, False, f"{self.name}-{role}-init{i}", image or self.image))
        name = f"{self.name}-{role}"
        self.run(*self.container_args(spec["containers"][0], volumes, True, name, image or self.image))
        self.containers.append(name)
        return name

    def exec(self, container: str, *cmd: str) -> subprocess.CompletedProcess:
        return self.run("exec", container, *cmd, check=False)

    def logs(self, container: str) -> str:
        return self.run("logs", container, check=False).stdout + self.run("logs", container, check=False).stderr

    def remove(self) -> None:
        self.run("pod", "rm", "-f", self.name, check=False)


def wait(what: str, predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"FAILED: timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(2)
    print(f"ok: {what}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default="localhost/tokserve:cpu")
    ap.add_argument("--overlay", default="kind")
    ap.add_argument("--router-image", default="", help="also run the overlay's vllm-router (e.g. "
                                                         "localhost/tokserve-router:0.1.17) and generate through it")
    ap.add_argument("--podman", default="podman", help="podman command line (global options included)")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    docs = render(args.overlay)
    by_name = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    work = Path(tempfile.mkdtemp(prefix="tokserve-pod-"))
    pod = Pod(shlex.split(args.podman), args.image, "tokserve-smoke", work)
    pod.remove()
    try:
        secrets = make_secrets(work)
        pod.create()
        broker = pod.start(by_name["tokserve-broker"], secrets)
        worker = pod.start(by_name["tokserve-worker"], secrets)
        gateway = pod.start(by_name["tokserve-gateway"], secrets)
        probe = by_name["tokserve-worker"]["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]
        wait("worker readiness probe passes (the broker registered it)",
             lambda: pod.exec(worker, *probe["command"]).returncode == 0, args.timeout)
        wait("gateway /health answers 200", lambda: pod.exec(gateway, "python", "-c", PROBE_HEALTH, "8000").returncode == 0,
             args.timeout)
        out = pod.exec(gateway, "python", "-c", PROBE_GENERATE, "8000")
        if out.returncode != 0:
            raise SystemExit(f"FAILED: generate: {out.stderr}")
        tokens = json.loads(out.stdout)
        assert len(tokens) == 8, tokens
        print(f"ok: generate through the gateway returned {tokens}")
        if args.router_image and "tokserve-router" in by_name:
            router_doc = json.loads(json.dumps(by_name["tokserve-router"]))
            router_args = router_doc["spec"]["template"]["spec"]["containers"][0]["args"]
            router_args[router_args.index("--port") + 1] = ROUTER_PORT
            pod.start(router_doc, secrets, args.router_image)

            def through_router():
                out = pod.exec(gateway, "python", "-c", PROBE_GENERATE, ROUTER_PORT)
                return out.returncode == 0 and json.loads(out.stdout) == tokens
            wait("vllm-router forwards a generate to the gateway (same tokens)", through_router, args.timeout)
            wait("vllm-router's readiness path /health answers 200",
                 lambda: pod.exec(gateway, "python", "-c", PROBE_HEALTH, ROUTER_PORT).returncode == 0, 60)
        compiled = "compiling the native CPU kernels" in pod.logs(worker)
        print(f"{'note' if compiled else 'ok'}: the worker {'compiled its kernels at start (another CPU than the build host?)' if compiled else 'loaded the kernels compiled into the image'}")
        pod.run("stop", "-t", "10", broker)
        wait("worker readiness probe fails once the broker is gone",
             lambda: pod.exec(worker, *probe["command"]).returncode != 0, 60)
        print("PASSED")
        return 0
    except BaseException:
        for c in pod.containers:
            print(f"--- {c}\n{pod.logs(c)[-3000:]}", file=sys.stderr)
        raise
    finally:
        pod.remove()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
