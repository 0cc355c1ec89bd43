"""`tokserve build-kernels`: compile the native CPU kernels now, at install time.

The README's install ends with it, so the first `tokserve serve` starts in seconds
instead of compiling for minutes; workers then import the built library directly
(worker/engine/kernels/__init__.py).  The build lands where a worker's lazy build
would (torch's extension cache, ``$TORCH_EXTENSIONS_DIR``, per user), keyed by CPU,
kernel sources and toolchain: run it again after upgrading torch (a worker would
otherwise rebuild on its first start, as before).

Without a compiler it says so and exits 0 (workers then use torch's ops: slower, but
everything works); ``--strict`` makes that an error, for CI.
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from common.logging import setup_logging


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokserve build-kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strict", action="store_true", help="exit 1 when the kernels cannot be built here")
    args = p.parse_args(argv)
    setup_logging("build-kernels", "WARNING")
    logging.getLogger("worker.engine.kernels").setLevel(logging.INFO)

    from worker.engine import kernels

    name = kernels.kernel_module_name(Path(kernels.__file__).parent)
    existed = (kernels.build_directory(name) / f"{name}.so").is_file()  # stamped or not: torch's load checks it
    started = time.monotonic()  # a compile announces itself in the log (kernels.BUILD_HINT)
    module = kernels.load_cpu_kernels()
    if module is None:
        print("tokserve: the native CPU kernels cannot be built here (see above); workers will use torch's ops")
        return 1 if args.strict else 0
    state = "already built" if existed else f"built in {time.monotonic() - started:.0f} s"
    print(f"tokserve: native CPU kernels {state}: {module.__file__}")
    return 0
