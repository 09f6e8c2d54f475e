"""The package without extras: a fresh virtual environment gets the simulator and the
services but neither torch nor NVML, replays a trace, and a policy that needs torch says
which extra brings it.

The environment is built by pip from a copy of the sources (pip builds in the source
folder, which here is shared), with the package index pip is configured with; without
an index the test is skipped, saying so."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "libs", "services")
#: generous: building the environment is seconds from pip's cache, a minute or two when
#: every wheel is downloaded; this only stops a pip that hangs
PIP_LIMIT_S = 900
#: the whole of a test here: pip's limit, the index check and the venv, with room
pytestmark = pytest.mark.timeout(PIP_LIMIT_S + 600)


def index_reachable(python: Path) -> str | None:
    """None when pip can list a package's versions, else why not."""
    done = subprocess.run(
        [python, "-m", "pip", "index", "versions", "msgspec"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode == 0:
        return None
    return (done.stderr.strip().splitlines() or ["no answer"])[-1]


@pytest.fixture(scope="module")
def lean_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("lean")
    source = base / "src"
    source.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, source / name)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    python = venv / "bin" / "python"
    why = index_reachable(python)
    if why is not None:
        print(f"skipped: pip reaches no package index: {why}")
        pytest.skip(f"pip reaches no package index: {why}")
    done = subprocess.run(
        [python, "-m", "pip", "install", "-q", str(source)],
        capture_output=True, text=True, timeout=PIP_LIMIT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def test_a_lean_install_has_neither_torch_nor_nvml(lean_venv: Path):
    for module in ("torch", "pynvml"):
        done = subprocess.run(
            [lean_venv / "bin" / "python", "-c", f"import {module}"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode != 0, module
        assert "ModuleNotFoundError" in done.stderr, done.stderr


def test_a_lean_install_replays_a_trace(lean_venv: Path, tmp_path: Path):
    out = tmp_path / "out"
    done = subprocess.run(
        [lean_venv / "bin" / "gpusched", "simulate", "--trace", "synthetic:30", "--cluster",
         "2x4", "--policy", "fifo,sjf-bsbf", "--out", out],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["policies"]) == {"fifo", "sjf-bsbf"}
    assert summary["policies"]["fifo"]["finished"] == 30


def test_a_policy_that_needs_torch_names_the_extra_in_a_lean_install(
    lean_venv: Path, tmp_path: Path
):
    done = subprocess.run(
        [lean_venv / "bin" / "gpusched", "simulate", "--trace", "synthetic:30", "--cluster",
         "2x4", "--policy", "ones", "--out", tmp_path / "out"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "pip install 'gpusched[train]'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_lean_install_runs_every_policy_it_can_when_none_is_named(
    lean_venv: Path, tmp_path: Path
):
    out = tmp_path / "out"
    done = subprocess.run(
        [lean_venv / "bin" / "gpusched", "simulate", "--trace", "synthetic:30", "--cluster",
         "2x4", "--out", out],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "left out: policy ones" in done.stderr
    ran = set(json.loads((out / "summary.json").read_text())["policies"])
    assert {"fifo", "sjf-bsbf", "tiresias", "synergy-fifo"} <= ran
    assert "ones" not in ran


def test_an_install_puts_only_the_gpusched_package_in_site_packages(lean_venv: Path):
    (site,) = (lean_venv / "lib").glob("python3*/site-packages")
    ours = {p.name for p in site.iterdir() if p.name in {"libs", "services", "gpusched"}}
    assert ours == {"gpusched"}
    assert {p.name for p in (site / "gpusched").iterdir()} >= {"libs", "services"}
    done = subprocess.run(
        [lean_venv / "bin" / "python", "-c", "import libs"],
        capture_output=True, text=True, cwd=site,
    )  # fmt: skip
    assert "ModuleNotFoundError" in done.stderr, done.stderr
    assert (site / "gpusched" / "libs" / "core" / "builtin" / "profiles.json").is_file()
