"""The manual: the docs site builds with warnings as errors (a link to a missing page
or anchor is a warning, mkdocs.yml's validation), the README stays the short front
page, and its install and test commands are exactly what CI (.ci/run) runs."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _fenced_commands(section: str) -> list[str]:
    """The command lines of the first ```bash block under README heading ``section``."""
    body = README.split(f"\n## {section}\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", body, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_docs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the [test] extra")
    pytest.importorskip("material", reason="mkdocs-material is in the [test] extra")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    home = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert "tokserve build-kernels" in home  # the README is the site's home page
    # every page of docs/ is in the navigation (omitted_files is a warning, so strict fails otherwise)
    for page in (ROOT / "docs").glob("*.md"):
        assert (tmp_path / "site" / page.stem / "index.html").exists(), page.name


def test_broken_link_fails_the_build(tmp_path):
    """The check above can fail: a page linking to a missing anchor aborts the build."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    import shutil
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copytree(ROOT / "docs_hooks", tmp_path / "docs_hooks")
    page = tmp_path / "docs" / "lora.md"
    page.write_text(page.read_text() + "\nSee [nowhere](security.md#no-such-section).\n")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no-such-section" in proc.stdout + proc.stderr


def test_readme_is_the_short_front_page():
    assert README.count("\n") < 250
    for page in re.findall(r"\]\(docs/([^)#]+)", README):
        assert (ROOT / "docs" / page).exists(), page


def test_readme_commands_are_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    install = _fenced_commands("Install")[0]
    # README: venv && activate && pip install ... && tokserve build-kernels; .ci/run: the same steps
    steps = [s.strip() for s in install.split("&&")]
    assert steps[0] == "python3 -m venv .venv" and "python3 -m venv .venv" in ci
    pip = next(s for s in steps if s.startswith("pip install"))
    assert f"python -m {pip}".replace("pip install", "pip install -q") in ci, (pip, ci)
    assert steps[-1] == "tokserve build-kernels" and "tokserve build-kernels --strict" in ci
    test_cmd = _fenced_commands("Test")[0]
    assert ci.strip().splitlines()[-1] == test_cmd
