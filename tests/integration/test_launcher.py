"""`tokserve serve`: the one-command stack on the demo model (built into a temp cache).

One launcher run covers: the demo model is built, two gateways share the port, the
stack answers a generate request, a worker killed with SIGKILL is restarted, and
SIGTERM stops every child.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import pytest

from tests.support.gateway_helpers import GENERATE, gen_body
from tests.support.procs import ProcGroup, free_port, wait_for


def _child_pids(log_text: str) -> dict[str, int]:
    """Latest pid per child name from the launcher's 'started NAME (pid N)' lines."""
    return {name: int(pid) for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", log_text)}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_demo_model_restart_worker_and_clean_shutdown(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A cold kernel cache whose build fails at once (no compiler): the first-start notice
    # must still come before the ready line, and the stack serves on torch's ops.
    env = {"TOKSERVE_CACHE": str(tmp_path / "cache"), "TOKSERVE_LOG_LEVEL": "INFO",
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": "/bin/false"}
    with ProcGroup(tmp_path / "logs") as procs:
        launcher = procs.spawn("launcher", [
            "-m", "common.cli", "serve", "--port", str(port), "--gateways", "2",
            "--frontend", f"ipc://{tmp_path}/frontend", "--backend", f"ipc://{tmp_path}/backend",
            "--worker-args", "--max-num-seqs 4 --num-kv-blocks 128 --threads 1"], env=env)
        try:
            wait_for(lambda: _healthy(url) or not launcher.alive(), 120, "stack health", interval=0.3)
            assert launcher.alive(), launcher.tail()
            assert (tmp_path / "cache").is_dir()  # the demo model was built there
            wait_for(lambda: "try: curl" in launcher.log_path.read_text(), 10, "the ready line")
            text = launcher.log_path.read_text()
            assert text.index("building the demo model") < text.index(f"tokserve ready: http://127.0.0.1:{port}")
            assert "weights loaded" in text and "engine ready" in text  # the worker's start-up progress
            assert text.index("compiling the native CPU kernels into") < text.index("tokserve ready")

            r = httpx.post(url + GENERATE, json=gen_body([72, 105], max_tokens=4, temperature=0, ignore_eos=True),
                           timeout=60)
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"][0]["token_ids"]) == 4

            pids = _child_pids(launcher.log_path.read_text())
            assert set(pids) == {"broker", "worker[0]", "gateway[0]", "gateway[1]"}  # two share the port
            os.kill(pids["worker[0]"], signal.SIGKILL)
            new_worker = wait_for(lambda: _child_pids(launcher.log_path.read_text())["worker[0]"]
                                  if _child_pids(launcher.log_path.read_text())["worker[0]"] != pids["worker[0]"]
                                  else None, 30, "worker restart")
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # the restarted worker registers again
                r = httpx.post(url + GENERATE, json=gen_body([72, 105], max_tokens=2), timeout=60)
                if r.status_code == 200:
                    break
                time.sleep(0.5)
            assert r.status_code == 200, r.text

            launcher.popen.send_signal(signal.SIGTERM)
            assert launcher.popen.wait(60) == 0
            children = _child_pids(launcher.log_path.read_text())
            assert children["worker[0]"] == new_worker
            wait_for(lambda: not any(_pid_alive(p) for p in children.values()), 10, "children to exit")
        except BaseException:
            print(launcher.tail(120))
            raise


def test_supervisord_config_programs_parse():
    """deploy/supervisord.conf loads, restarts everything, and every command line is one
    its subcommand's own argument parser accepts (catches flag drift)."""
    import importlib
    import shlex
    from pathlib import Path

    from supervisor.options import ServerOptions

    from common.cli import COMMANDS

    conf = Path(__file__).resolve().parents[2] / "deploy" / "supervisord.conf"
    opts = ServerOptions()
    opts.realize(args=["-c", str(conf)])
    programs = {p.name: p for g in opts.process_group_configs for p in g.process_configs}
    assert {"broker", "worker-0", "gateway-0", "gateway-1"} <= set(programs)
    for name, prog in programs.items():
        assert prog.autorestart, name
        argv = shlex.split(prog.command)
        assert argv[:3] == ["python", "-m", "common.cli"], prog.command
        module = importlib.import_module(COMMANDS[argv[3]][0].split(":")[0])
        module.build_parser().parse_args(argv[4:])
    assert programs["worker-0"].environment == {"CUDA_VISIBLE_DEVICES": "0"}
    assert "--rank 0" in programs["worker-0"].command


def test_launcher_plans_cuda_ranks_shared_port_and_secret_env():
    from common.launcher import build_parser, plan_children

    args = build_parser().parse_args(["--workers", "2", "--device", "cuda:3", "--gateways", "2", "--api-key", "k",
                                      "--worker-args", "--max-num-seqs 8", "--tokens-only",
                                      "--broker-args", "--curve-authorized-keys '/keys/my clients'"])
    broker, workers, gateways = plan_children(args, "/models/m")
    assert broker.argv[3] == "broker"
    assert broker.argv[-2:] == ["--curve-authorized-keys", "/keys/my clients"]  # shell-style quoting kept
    for rank, w in enumerate(workers):
        assert w.env == {"CUDA_VISIBLE_DEVICES": str(rank)}
        assert w.argv[w.argv.index("--device") + 1] == "cuda"  # its only visible GPU
        assert w.argv[w.argv.index("--rank") + 1] == str(rank)
        assert w.argv[-3:] == ["--max-num-seqs", "8", "--tokens-only"]
    for g in gateways:
        assert "--reuse-port" in g.argv and "--tokens-only" in g.argv
        assert "k" not in g.argv and g.env == {"TOKSERVE_API_KEY": "k"}
        assert "--enable-per-request-metrics" not in g.argv
        assert "--enable-prompt-tokens-details" not in g.argv
    _, workers, gateways = plan_children(build_parser().parse_args(["--enable-per-request-metrics",
                                                                    "--return-tokens-as-token-ids",
                                                                    "--enable-prompt-tokens-details",
                                                                    "--limit-mm-per-prompt", '{"image": 2}']), "/m")
    assert "--enable-per-request-metrics" in gateways[0].argv and "--enable-per-request-metrics" not in workers[0].argv
    assert "--return-tokens-as-token-ids" in gateways[0].argv and "--return-tokens-as-token-ids" not in workers[0].argv
    assert "--enable-prompt-tokens-details" in gateways[0].argv
    assert "--enable-prompt-tokens-details" not in workers[0].argv
    argv = gateways[0].argv
    assert argv[argv.index("--limit-mm-per-prompt") + 1] == '{"image": 2}' and "--limit-mm-per-prompt" not in workers[0].argv
    # No images at all: the workers load no vision tower (a vision-language model served as its LM).
    _, workers, gateways = plan_children(build_parser().parse_args(["--limit-mm-per-prompt", '{"image": 0}']), "/m")
    for child in (workers[0], gateways[0]):
        assert child.argv[child.argv.index("--limit-mm-per-prompt") + 1] == '{"image": 0}'


def test_cpu_workers_leave_a_cpu_to_the_front_end():
    from common.launcher import build_parser, cpu_worker_threads, plan_children

    assert [cpu_worker_threads(1, c) for c in (1, 2, 4, 16)] == [1, 1, 3, 15]
    assert cpu_worker_threads(2, 16) == 7 and cpu_worker_threads(4, 2) == 1
    _, workers, _ = plan_children(build_parser().parse_args(["--workers", "2"]), "/m")
    assert all(w.argv[w.argv.index("--threads") + 1] == str(cpu_worker_threads(2)) for w in workers)
    _, workers, _ = plan_children(build_parser().parse_args(["--worker-args", "--threads 5"]), "/m")
    assert workers[0].argv.count("--threads") == 1 and workers[0].argv[-1] == "5"  # the operator's choice wins
    _, workers, _ = plan_children(build_parser().parse_args(["--device", "cuda"]), "/m")
    assert "--threads" not in workers[0].argv


def test_launcher_gives_each_tensor_parallel_worker_its_gpus():
    from common.launcher import build_parser, cpu_worker_threads, plan_children

    _, workers, _ = plan_children(build_parser().parse_args(["--workers", "2", "--device", "cuda",
                                                             "--tensor-parallel-size", "2"]), "/m")
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["0,1", "2,3"]
    assert all(w.argv[w.argv.index("--tensor-parallel-size") + 1] == "2" for w in workers)
    _, workers, _ = plan_children(build_parser().parse_args(["--tensor-parallel-size", "2"]), "/m")
    assert workers[0].argv[workers[0].argv.index("--threads") + 1] == str(cpu_worker_threads(2))  # per rank


def test_replay_flags_reach_workers_and_gateways():
    from common.launcher import build_parser, plan_children

    flags = ["--enable-return-routed-experts", "--return-sampling-mask"]
    _, workers, gateways = plan_children(build_parser().parse_args(["--gateways", "2", *flags]), "/m")
    assert all(set(flags) <= set(c.argv) for c in workers + gateways)
    _, workers, gateways = plan_children(build_parser().parse_args([]), "/m")
    assert not any(f in c.argv for c in workers + gateways for f in flags)


def test_lora_flags_reach_workers_and_gateways():
    from common.launcher import build_parser, plan_children
    from worker.main import parse_lora_modules

    args = ["--gateways", "2", "--lora-modules", "a=/ad/a", '{"name": "b", "path": "/ad/b"}', "--max-loras", "3",
            "--max-lora-rank", "32", "--allow-runtime-lora"]
    _, workers, gateways = plan_children(build_parser().parse_args(args), "/m")
    for w in workers:
        assert "--enable-lora" in w.argv and w.argv[w.argv.index("--max-loras") + 1] == "3"
        i = w.argv.index("--lora-modules")
        assert parse_lora_modules(w.argv[i + 1:i + 3]) == {"a": "/ad/a", "b": "/ad/b"}
        assert w.argv[w.argv.index("--max-lora-rank") + 1] == "32" and "--max-cpu-loras" not in w.argv
    assert all("--allow-runtime-lora" in g.argv for g in gateways)
    _, workers, gateways = plan_children(build_parser().parse_args([]), "/m")
    assert not any("lora" in a for c in workers + gateways for a in c.argv)
    with pytest.raises(ValueError, match="expected name=path"):
        parse_lora_modules(["nameonly"])


def test_speculative_flags_reach_workers_and_gateways():
    from common.launcher import build_parser, plan_children

    cfg = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = ["--speculative-config", cfg, "--per-request-spec-decode-metrics", "summary", "--gateways", "2"]
    _, workers, gateways = plan_children(build_parser().parse_args(args), "/m")
    assert all(w.argv[w.argv.index("--speculative-config") + 1] == cfg for w in workers)
    assert all(g.argv[g.argv.index("--per-request-spec-decode-metrics") + 1] == "summary" for g in gateways)


def test_structured_outputs_config_reaches_gateways_and_bad_values_stop_serve():
    from common.launcher import build_parser, plan_children

    cfg = '{"backend": "xgrammar", "disable_any_whitespace": true}'
    _, workers, gateways = plan_children(build_parser().parse_args(["--structured-outputs-config", cfg,
                                                                    "--gateways", "2"]), "/m")
    assert all(json.loads(g.argv[g.argv.index("--structured-outputs-config") + 1]) == json.loads(cfg)
               for g in gateways)
    with pytest.raises(SystemExit, match="not served by tokserve"):
        plan_children(build_parser().parse_args(["--structured-outputs-config", '{"backend": "outlines"}']), "/m")


def test_common_imports_no_other_package_of_ours():
    """Layering: common/ is what every process shares; it must not pull in the worker,
    the broker or the gateway (the launcher asks `tokserve demo-model` for the demo model)."""
    import ast
    from pathlib import Path

    ours = {"worker", "broker", "gateway", "benchmarks", "tests"}
    hits = []
    for path in (Path(__file__).resolve().parents[2] / "common").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            hits += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] in ours]
    assert not hits, hits


def test_launcher_builds_the_demo_model_through_the_worker_cli(tmp_path, monkeypatch):
    from common.launcher import build_demo_model_dir

    monkeypatch.setenv("TOKSERVE_CACHE", str(tmp_path))
    path = build_demo_model_dir()
    assert path.startswith(str(tmp_path)) and (tmp_path / path.split("/")[-1] / "config.json").is_file()


def test_crash_loop_stops_the_launcher_with_the_error(tmp_path):
    """A worker that can never start (a bad flag: argparse's exit code 2) stops the
    launcher with its error instead of being restarted forever."""
    env = {"TOKSERVE_CACHE": str(tmp_path / "cache")}
    with ProcGroup(tmp_path / "logs") as procs:
        launcher = procs.spawn("launcher", [
            "-m", "common.cli", "serve", "--port", str(free_port()), "--frontend", f"ipc://{tmp_path}/f",
            "--backend", f"ipc://{tmp_path}/b", "--worker-args", "--bogus-flag"], env=env)
        assert launcher.popen.wait(120) == 1
        text = launcher.log_path.read_text()
        assert "worker[0] rejected its command line (exit code 2); stopping" in text
        assert "unrecognized arguments: --bogus-flag" in text
        assert text.count("started worker[0]") == 1  # not restarted


def test_children_failing_during_startup_are_a_crash_loop():
    import sys

    from common.launcher import MAX_STARTUP_FAILURES, Child

    child = Child("flaky", [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(1)"])
    for attempt in range(1, MAX_STARTUP_FAILURES + 1):
        child.start()
        child.proc.wait()
        time.sleep(0.2)
        reason = child.fatal()
        if attempt < MAX_STARTUP_FAILURES:
            assert reason is None
            child.schedule_restart()
    assert reason == f"flaky exited during start-up {MAX_STARTUP_FAILURES} times in a row (last exit code 1)"
    assert "boom" in child.tail
    child.healthy = True  # once healthy, exits are restarted with backoff again
    assert child.fatal() is None


def test_pass_through_args_take_a_single_flag():
    from common.launcher import build_parser, join_pass_through, plan_children

    args = build_parser().parse_args(join_pass_through(["--worker-args", "--enforce-eager", "--port", "9"]))
    assert args.worker_args == "--enforce-eager" and args.port == 9
    _, workers, _ = plan_children(args, "/m")
    assert "--enforce-eager" in workers[0].argv


def test_kernel_build_is_announced_on_a_cold_cache(tmp_path):
    """A first start says it is compiling (and roughly how long) before the build."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import logging, torch.utils.cpp_extension as ce; logging.basicConfig(level=logging.INFO)\n"
            "def fail(**kw): raise RuntimeError('no compiler in this test')\n"
            "ce.load = fail\n"
            "from worker.engine.kernels import load_cpu_kernels; assert load_cpu_kernels() is None")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), PYTHONPATH=str(root)))
    assert proc.returncode == 0, proc.stderr
    from worker.engine.kernels import BUILD_HINT

    notice = proc.stderr.index(f"compiling the native CPU kernels into {tmp_path}")
    assert BUILD_HINT in proc.stderr[notice:]  # how long, and how to do it at install time instead
    assert notice < proc.stderr.index("native CPU kernels unavailable (no compiler in this test)")


def test_disaggregation_roles_reach_broker_and_workers():
    from common.launcher import build_parser, plan_children
    from worker.engine.disagg.ec_transfer import parse_ec_transfer_config

    broker, workers, _ = plan_children(build_parser().parse_args(
        ["--workers", "4", "--prefill-workers", "1", "--encoder-workers", "1"]), "/m")
    assert "--pd" in broker.argv and "--epd" in broker.argv
    assert workers[0].argv[workers[0].argv.index("--role") + 1] == "prefill"
    assert [w.argv[w.argv.index("--role") + 1] for w in workers[1:3]] == ["decode", "decode"]
    enc = workers[3].argv
    assert "--mm-encoder-only" in enc and "--role" not in enc
    assert parse_ec_transfer_config(enc[enc.index("--ec-transfer-config") + 1]) == "ec_producer"
    broker, workers, _ = plan_children(build_parser().parse_args(["--workers", "2"]), "/m")
    assert "--epd" not in broker.argv and not any("--mm-encoder-only" in w.argv for w in workers)
    for argv in (["--encoder-workers", "1"], ["--workers", "2", "--prefill-workers", "1", "--encoder-workers", "1"]):
        with pytest.raises(SystemExit, match="at least one worker for the language model"):
            plan_children(build_parser().parse_args(argv), "/m")


def test_async_scheduling_flags_reach_workers():
    from common.launcher import build_parser, plan_children

    for flags, expected in (([], None), (["--async-scheduling"], "--async-scheduling"),
                            (["--no-async-scheduling"], "--no-async-scheduling")):
        _, workers, gateways = plan_children(build_parser().parse_args(flags), "/m")
        passed = [a for a in workers[0].argv if a.endswith("async-scheduling")]
        assert passed == ([expected] if expected else [])
        assert not any(a.endswith("async-scheduling") for g in gateways for a in g.argv)
