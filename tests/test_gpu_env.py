"""scripts/gpu_env.sh, the replica of the GPU machine's environment (issue 42): it refuses by name what it cannot do
(no Python 3.12, a virtualenv inside the checkout), its pins are the GPU machine's versions, the package's torch
floor is the oldest torch CI tests, and CI runs it after the suite. (The replica itself runs in CI, not here.)"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_env.sh"


def _run(env: dict, *args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVSLIM_GPU_", "PYENV"))}
    return subprocess.run(["bash", str(SCRIPT), "--setup-only", *args], env={**base, **env}, capture_output=True,
                          text=True, timeout=120)


def test_refuses_by_name_without_python_312(tmp_path):
    out = _run({"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYENV_ROOT": str(tmp_path),
                "KVSLIM_GPU_PYTHON": "/nonexistent/python3.12"})
    if "environment" in out.stdout:  # this machine has a python3.12 in /usr/bin: nothing to refuse
        return
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Python 3.12 not found" in out.stderr and "KVSLIM_GPU_PYTHON" in out.stderr


def test_never_makes_its_virtualenv_inside_the_checkout(tmp_path):
    venv = ROOT / ".venv"
    before = sorted(p.name for p in venv.iterdir()) if venv.is_dir() else None
    for inside in (venv, ROOT / "gpu-env"):
        out = _run({"KVSLIM_GPU_ENV_DIR": str(inside)})
        assert out.returncode == 2 and "refusing" in out.stderr and "outside the checkout" in out.stderr, out.stderr
    assert (sorted(p.name for p in venv.iterdir()) if venv.is_dir() else None) == before
    assert not (ROOT / "gpu-env").exists()


def _pins() -> dict[str, str]:
    line = re.search(r"^PINS=\((.*?)\)", SCRIPT.read_text(), re.M | re.S).group(1)
    return dict(p.split("==") for p in line.split())


def test_pins_are_the_gpu_machines_versions_and_the_torch_floor():
    pins = _pins()
    assert (pins["torch"], pins["triton"], pins["transformers"]) == ("2.11.0", "3.6.0", "5.17.0")
    assert "kvslim" not in pins  # src on PYTHONPATH, as on the GPU machine
    floor = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert tuple(int(x) for x in floor.split(".")) == tuple(int(x) for x in pins["torch"].split(".")[:2])


def test_ci_runs_the_replica_after_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    suite = ".venv/bin/python -m pytest -n 2 --dist loadfile"
    assert f"bash scripts/setup.sh && {suite}" in readme and f"bash scripts/setup.sh && {suite}" in ci
    assert ci.index(suite) < ci.index("bash scripts/gpu_env.sh")
    assert "set -euo pipefail" in ci


def test_refuses_a_path_in_the_checkout_that_links_elsewhere(tmp_path):
    """A path inside the checkout that is a symlink to a folder elsewhere (a clone whose .venv links to another
    checkout's) is refused as given: resolved, it lay outside, and the script replaced the folder it linked to."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    link = ROOT / "gpu-env-link-test"
    link.symlink_to(target, target_is_directory=True)
    try:
        out = _run({"KVSLIM_GPU_ENV_DIR": str(link)})
    finally:
        link.unlink()
    assert out.returncode == 2 and "refusing" in out.stderr, out.stderr
    assert (target / "keep").read_text() == "x" and sorted(p.name for p in target.iterdir()) == ["keep"]
