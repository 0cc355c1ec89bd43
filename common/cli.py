"""`tokserve` command: one entry point dispatching to each process's own main()."""
from __future__ import annotations

import importlib
import sys

# subcommand -> "module:function"; each function takes argv (list[str]) and returns an exit code.
COMMANDS = {
    "serve": ("common.launcher:main", "start broker, workers and gateway together (demo model when no --model)"),
    "broker": ("broker.main:main", "run the ZeroMQ broker"),
    "worker": ("worker.main:main", "run one inference worker (one per GPU)"),
    "gateway": ("gateway.main:main", "run the HTTP gateway (Falcon ASGI on uvicorn)"),
    "build-kernels": ("worker.engine.kernels.build:main",
                      "compile the native CPU kernels now (the install's last step) instead of at first start"),
    "models": ("worker.engine.models.catalog:main", "list the supported model architectures and what each supports"),
    "demo-model": ("worker.engine.loading.demo_model:main", "build the seeded random-weight demo model"),
    "bench": ("benchmarks.bench_serve:main", "benchmark a deployment like `vllm bench serve` (tokserve bench serve)"),
    "worker-ready": ("common.readiness:main", "readiness probe: exit 0 while the broker acknowledges a worker (its --ready-file)"),
    "curve-keys": ("common.security:main", "create a CURVE certificate (key files) for encrypted broker links"),
    "cells": ("common.cells_control:main", "fan an RL control operation (pause, weights, LoRA) out to every cell"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: tokserve {%s} [options]\n" % ",".join(COMMANDS))
        for name, (_, doc) in COMMANDS.items():
            print(f"  {name:<11} {doc}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, func = COMMANDS[argv[0]][0].split(":")
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
