"""Weight-update throughput of the RL control plane, measured side by side in one run.

For each model size: a broker and ``--workers`` real workers serving the preset
model; then the same new weights (another seed of the preset) are pushed

* over ZeroMQ frames through the direct client (``Client.update_weights``), and
* over torch.distributed gloo on loopback (the trainer is this process, rank 0),

each inside pause(keep) -> start -> update -> finish -> resume, as an RL loop does.
Prints GB/s of weight bytes delivered to the pool (bytes x workers / seconds) and
the pause->update->resume wall time.  CPU figures; a GPU run would use NCCL.

    python -m benchmarks.weight_update                 # 125m and 500m, 1 worker
    python -m benchmarks.weight_update --sizes 125m --workers 2
"""
from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from safetensors.torch import load_file

from benchmarks.model_presets import build_preset_model
from common.client import Client
from common.dist_weight_transfer import TrainerWeightSender
from tests.support.procs import ProcGroup, free_port, wait_for_workers


def _push_zmq(client: Client, named, version: str) -> float:
    started = time.perf_counter()
    client.pause("keep")
    client.update_weights(named, version)
    client.resume()
    return time.perf_counter() - started


def _push_gloo(client: Client, named, version: str, workers: int, bucket_bytes: int) -> float:
    sender = TrainerWeightSender("127.0.0.1", free_port(), world_size=1 + workers, packed=True,
                                 packed_buffer_size_bytes=bucket_bytes, backend="gloo")
    joined = threading.Thread(target=sender.connect)
    joined.start()
    client.control("init_weight_transfer_engine", {"init_info": sender.init_info()})
    joined.join()
    started = time.perf_counter()
    client.pause("keep")
    client.control("start_weight_update")
    sending = threading.Thread(target=sender.send, args=(named,))
    sending.start()
    client.control("update_weights", {"update_info": sender.update_info(named)})
    sending.join()
    client.control("finish_weight_update", {"weight_version": version})
    client.resume()
    elapsed = time.perf_counter() - started
    client.control("shutdown_weight_transfer_engine")
    return elapsed


def run(size: str, workers: int, repeats: int, bucket_mb: int, cpu_linear: str) -> list[tuple]:
    base = build_preset_model(size)
    new = build_preset_model(size, seed=1)
    named = sorted(load_file(str(new / "model.safetensors")).items())
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    rows = []
    with tempfile.TemporaryDirectory() as logs, ProcGroup(Path(logs)) as procs:
        broker = procs.broker()
        for rank in range(workers):
            procs.worker(broker, rank, "--model", str(base), "--threads", "1", "--num-kv-blocks", "64",
                         "--max-num-seqs", "8", "--max-model-len", "512", "--cpu-linear", cpu_linear)
        wait_for_workers(broker.frontend, workers, timeout=600)
        with Client(broker.frontend) as client:
            for transport in ("zmq", "gloo"):
                times = []
                for i in range(repeats):
                    version = f"{transport}-{i}"
                    if transport == "zmq":
                        times.append(_push_zmq(client, named, version))
                    else:
                        times.append(_push_gloo(client, named, version, workers, bucket_mb << 20))
                    assert client.weight_info()["weight_version"] == version
                best = min(times)
                rows.append((size, cpu_linear, transport, workers, nbytes / 1e9, best, nbytes * workers / best / 1e9))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.weight_update", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["125m", "500m"])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="updates per transport (best one is reported)")
    p.add_argument("--bucket-mb", type=int, default=256, help="gloo packed buffer size")
    p.add_argument("--cpu-linear", nargs="+", default=["auto"], choices=["auto", "native", "onednn", "torch"],
                   help="workers' CPU GEMMs: oneDNN-packed weights are re-packed after an update")
    args = p.parse_args(argv)
    rows = []
    for size in args.sizes:
        for linear in args.cpu_linear:
            rows.extend(run(size, args.workers, args.repeats, args.bucket_mb, linear))
    print(f"{'model':>6} {'linears':>7} {'transport':>9} {'workers':>7} {'GB':>6} {'pause->update->resume s':>24} "
          f"{'GB/s':>6}")
    for size, linear, transport, workers, gb, secs, rate in rows:
        print(f"{size:>6} {linear:>7} {transport:>9} {workers:>7} {gb:6.2f} {secs:24.2f} {rate:6.2f}")
    print("(CPU, loopback; fp32 weights; GB/s counts the bytes every worker received)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
