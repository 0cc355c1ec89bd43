"""The native CPU kernels' instruction-set paths that this machine cannot run still
compile: the build is ``-march=native``, so a CPU with AVX512-BF16 (the AMD EPYCs and Intel
Cooper Lake / Sapphire Rapids users serve bf16 on) compiles the ``vdpbf16ps`` GEMM and the
AVX-512 attention paths that an AVX2 box never builds.  Each source is compiled for such a
target (syntax and types, no code generated), with torch's headers and the build's flags;
running those paths needs such a CPU (the GEMM's start-up trial against an fp32 GEMM
refuses it there if it computes wrong: worker/engine/models/cpu_gemm.py)."""
from __future__ import annotations

import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from worker.engine.kernels import CFLAGS, SOURCES

KERNELS = Path(__file__).resolve().parents[2] / "worker" / "engine" / "kernels"
# AVX512-BF16 without AMX, as the Zen 4 EPYCs (this gcc has no -march=znver4); the kernels
# have no AMX paths of their own.
TARGET = "cooperlake"


def _isa_specific() -> list[str]:
    """The sources with code of their own per instruction set (the others are plain C++
    the compiler vectorizes for whatever target it builds)."""
    return [s for s in SOURCES if "__AVX512" in (KERNELS / s).read_text()]


def _knows_target() -> bool:
    """Whether this g++ can target ``TARGET`` (GCC 10+)."""
    if shutil.which("g++") is None:
        return False
    proc = subprocess.run(["g++", f"-march={TARGET}", "-x", "c++", "-fsyntax-only", "-"], input="int main() {}\n",
                          capture_output=True, text=True, timeout=60)
    return proc.returncode == 0


@pytest.mark.skipif(not _knows_target(), reason=f"no g++ that targets -march={TARGET}")
def test_avx512_bf16_paths_compile():
    from torch.utils.cpp_extension import include_paths

    sources = _isa_specific()
    assert "bf16_gemm.cpp" in sources and "decode_attention.cpp" in sources
    flags = [f for f in CFLAGS if not f.startswith("-march")] + [f"-march={TARGET}"]
    includes = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]

    def check(source: str) -> tuple[str, int, str]:
        proc = subprocess.run(["g++", "-fsyntax-only", "-std=c++17", *flags, *includes,
                               "-DTORCH_EXTENSION_NAME=tokserve_isa_check", str(KERNELS / source)],
                              capture_output=True, text=True, timeout=600)
        return source, proc.returncode, proc.stderr

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(check, sources))
    failed = [(s, err[-2000:]) for s, rc, err in results if rc != 0]
    assert not failed, failed
