"""Every third-party module the serving packages import is a declared runtime dependency
(pyproject's [project] dependencies), so `pip install tokserve` (the container images do
exactly that) gets it.  The test environment installs more ([test] extra), which is how
a gateway importing PIL with pillow declared only for tests went unnoticed until the image
ran it."""
from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML reader")

ROOT = Path(__file__).resolve().parents[3]
SERVING = ("common", "broker", "worker", "gateway")
OURS = {"common", "broker", "worker", "gateway", "benchmarks", "tests"}
# Imported only where present, behind a check: CUDA attention backends and Triton kernels.
OPTIONAL = {"flash_attn", "vllm", "triton"}
# Installed by a declared dependency that cannot exist without it.
VIA = {"typing_extensions": "torch"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _third_party_imports() -> dict[str, str]:
    found: dict[str, str] = {}
    for pkg in SERVING:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in OURS and top not in sys.stdlib_module_names:
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_imported_third_party_module_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_norm(re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0]) for d in project["dependencies"]}
    dists = metadata.packages_distributions()
    missing = []
    for module, where in _third_party_imports().items():
        if module in OPTIONAL:
            continue
        if module in VIA:
            assert _norm(VIA[module]) in declared
            continue
        owners = {_norm(d) for d in dists.get(module, [module])}
        if not owners & declared:
            missing.append(f"{module} (imported by {where}; distribution {sorted(owners)})")
    assert not missing, "not in [project] dependencies: " + ", ".join(missing)
