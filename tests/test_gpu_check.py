"""The GPU check (bench/gpu_check.py) on this machine's CPU: every step runs, says it ran
without a GPU, and writes figures a GPU run would write in the same places. Its GPU
figures live in docs/results.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpusched.libs.core.profiles.measured import parse_profile

ROOT = Path(__file__).resolve().parents[1]
#: the check's own subprocess limit (1500 s), with room
pytestmark = pytest.mark.timeout(1800)


def test_the_gpu_check_runs_every_step_on_the_cpu_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # the budget only bounds each step; a slow machine gets all it needs
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--quick", "--budget-s", "1200",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ran without a GPU" in done.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["device"] == "cpu"
    assert report["nvml"]["gpus"] == [] and report["nvml"]["why"]
    for model, entry in report["profile"]["models"].items():
        [point] = entry["results"]
        assert point["median_iteration_s"] > 0 and point["gpu_mem_mb"] > 0, model
        assert point["profiled_iteration_s"] > 0, model
    profile = parse_profile(json.loads(Path(report["profile_file"]).read_text()),
                            report["profile_file"])
    assert set(profile.models) == set(report["profile"]["models"])
    colocation = report["colocation"]
    assert all(v and v > 0 for v in colocation["iteration_s"].values()), colocation
    assert set(colocation["measured_slowdown"]) == set(colocation["predicted_slowdown"])
    assert all(v >= 1 for v in colocation["predicted_slowdown"].values())
    live = report["live"]
    assert [j["state"] for j in live["jobs"]] == ["SUCCEEDED"] * 3, live["jobs"]
    assert live["shared_pairs"], "no two jobs shared the GPU"
    assert any("emulated" in line for line in live["banner"])
