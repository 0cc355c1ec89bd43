"""Native CPU kernels (decode and prefill attention over the paged cache, RMSNorm,
SwiGLU, rotary; one library serves float32 and bfloat16 storage, each function
dispatching on its inputs' dtype; the attention kernels also read an FP8 KV cache), compiled by ``torch.utils.cpp_extension`` into
torch's extension cache: at install time by ``tokserve build-kernels`` (worker/engine/kernels/build.py,
the last step of the README's install), else on first use (45 s on an idle machine,
about 3 minutes on a busy one; needs a C++ compiler and ninja).  Where they cannot be
built the engine keeps torch's kernels and says so once in the log.

A build that completed is recorded next to its library (``STAMP``: the torch, Python
and library it was made with); a later load imports that library directly, with no
compiler or ninja involved.  A library without a matching stamp (built by another
torch, half-written, replaced) goes through torch's ``load``, which rebuilds what it
must: the direct import is a shortcut, never a way around the checks.

The build is tuned for the CPU it runs on (``-march=native``), so the module name
carries a hash of the CPU's feature flags (a cache shared between different
machines never loads code the CPU can't run), of the kernel files, and of the
toolchain that goes into the compile command (torch's version and install path,
Python's headers, the compiler, the flags).  The files are compiled from a copy
inside the build directory, not from where the package sits.  Torch's ninja build
rebuilds whenever a source path or the command line changes, so without both two
checkouts (or an editable and an installed copy, or two virtual environments) of
the same kernels would rebuild each other's on every alternate start; this way one
environment's checkouts and installed copies share one build, and each environment
(or torch upgrade in place, whose headers ninja does not track) gets its own.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)

SOURCES = ("cpu_kernels.cpp", "decode_attention.cpp", "prefill_attention.cpp", "bf16_gemm.cpp", "int4_gemm.cpp")
HEADERS = ("paged_cache.h", "vec_math.h", "fp8_storage.h")
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd")
# torch's build lock is a bare file: a build killed mid-way (SIGKILL, Ctrl-C at the
# wrong moment) leaves it behind and every later load would wait on it forever.  A
# build takes 45 s to 3 minutes here, so a lock this old has no live owner.
STALE_LOCK_S = 300.0
STAMP = "tokserve-build.json"  # written beside the library once a build loaded fine
BUILD_HINT = "1 to 3 minutes, once per machine and torch install; `tokserve build-kernels` does it at install time"
_lock = threading.Lock()
_module: Optional[Any] = None
_tried = False


def _cpu_tag() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def _source_tag(here: Path) -> str:
    """Hash of every kernel file: torch's own rebuild check hashes the sources but
    not the headers they include, so an edited header could load a stale build."""
    h = hashlib.sha1()
    for f in SOURCES + HEADERS:
        h.update((here / f).read_bytes())
    return h.hexdigest()[:8]


def _toolchain_tag() -> str:
    """Hash of what torch writes into the compile and link commands besides the
    sources: torch's install path (its include and library dirs), its version (a
    reinstall in place changes headers ninja does not track), Python's include dir,
    the compiler (``CXX``, as torch reads it) and our flags."""
    import sysconfig

    parts = (torch.__version__, str(getattr(torch.version, "git_version", "")),
             os.path.dirname(os.path.abspath(torch.__file__)),
             str(sysconfig.get_path("include", scheme="posix_prefix")), os.environ.get("CXX", "c++"), *CFLAGS)
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:8]


def kernel_module_name(here: Path) -> str:
    """Keyed by CPU, kernel content and toolchain, not by where the kernels sit."""
    return f"tokserve_cpu_kernels_{_cpu_tag()}_{_source_tag(here)}_{_toolchain_tag()}"


def stage_sources(here: Path, dest: Path) -> Path:
    """Copy the kernel files into ``dest`` (once per content: the module name already
    hashes it), atomically per file so concurrent loaders never see a partial one."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in SOURCES + HEADERS:
        data = (here / f).read_bytes()
        target = dest / f
        if target.is_file() and target.read_bytes() == data:
            continue
        tmp = dest / f".{f}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, target)
    return dest


def build_directory(name: str) -> Path:
    """Where torch's extension cache keeps the build of module ``name`` (created if missing)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def _stamp_fields(library: Path) -> dict:
    """What a library's stamp must say for this process to import it directly."""
    st = library.stat()
    return {"module": library.stem, "torch": torch.__version__,
            "torch_git": str(getattr(torch.version, "git_version", "")),
            "python": sys.implementation.cache_tag, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_stamp(library: Path) -> None:
    tmp = library.parent / f".{STAMP}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(_stamp_fields(library)))
    os.replace(tmp, library.parent / STAMP)


def prebuilt_library(name: str) -> Optional[Path]:
    """The completed build of ``name`` for this torch and Python, or None."""
    build_dir = build_directory(name)
    library = build_dir / f"{name}.so"
    try:
        stamp = json.loads((build_dir / STAMP).read_text())
        return library if stamp == _stamp_fields(library) else None
    except (OSError, ValueError):
        return None


def _import_library(name: str, library: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile_and_load(here: Path, name: str) -> Any:
    """torch's ``load``: builds what is missing or stale (ninja), then imports it."""
    from torch.utils.cpp_extension import load

    build_dir = build_directory(name)
    _clear_stale_lock(build_dir / "lock")
    if not (build_dir / f"{name}.so").is_file():
        log.warning("compiling the native CPU kernels into %s (%s)", build_dir, BUILD_HINT)
    src = stage_sources(here, build_dir / "src")
    started = time.monotonic()
    module = load(name=name, sources=[str(src / s) for s in SOURCES], extra_cflags=list(CFLAGS), verbose=False)
    if time.monotonic() - started > 5:
        log.info("native CPU kernels ready (%.0f s)", time.monotonic() - started)
    write_stamp(Path(module.__file__))
    return module


def load_cpu_kernels() -> Optional[Any]:
    """The compiled kernels module, or None when it can't be built here (logged once)."""
    global _module, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                here = Path(__file__).parent
                name = kernel_module_name(here)
                library = prebuilt_library(name)
                if library is not None:
                    try:
                        _module = _import_library(name, library)
                    except (ImportError, OSError) as e:  # e.g. deleted or replaced meanwhile
                        log.warning("cannot import the built CPU kernels %s (%s); rebuilding", library, e)
                if _module is None:
                    _module = _compile_and_load(here, name)
            except Exception as e:  # no compiler / ninja / headers: torch's kernels still work
                log.warning("native CPU kernels unavailable (%s); using torch's ops",
                            str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return _module


def resolve_cpu_kernels(choice: str, device: torch.device, dtype: torch.dtype) -> Optional[Any]:
    """The kernels module for ``cpu_attention=choice`` (auto/native/torch) on this
    device and dtype, or None for torch's ops.  They serve float32 and bfloat16 (float32
    math) on CPU; an explicit ``native`` that can't be served is an error, not a silent
    fallback."""
    if device.type != "cpu" or choice == "torch":
        return None
    if dtype not in (torch.float32, torch.bfloat16):
        if choice == "native":
            raise ValueError("cpu_attention=native needs dtype float32 or bfloat16")
        return None
    module = load_cpu_kernels()
    if module is None and choice == "native":
        raise ValueError("cpu_attention=native: the CPU kernels could not be built (see the log)")
    return module


def _clear_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return  # no lock: nobody is building
    if age > STALE_LOCK_S:
        log.warning("removing a stale kernel build lock (%.0f s old): %s", age, lock)
        try:
            os.unlink(lock)
        except OSError:
            pass
    else:
        log.warning("another process is building the native CPU kernels (%.0f s so far; %s); waiting for it",
                    age, BUILD_HINT)
