"""Synergy's generated workload (``--trace synergy:N``) and ``--measure-ids``."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpusched.libs.core.groundtruth import ProfilePerformanceModel
from gpusched.libs.core.workload import (
    in_id_range,
    job_number,
    parse_id_range,
    synergy_count,
    synergy_models,
    synergy_trace,
)
from gpusched.services.cli.main import app

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
BY_CLASS = {"image": ("i1", "i2"), "language": ("l1", "l2", "l3"), "speech": ("s1",)}


def trace(n: int = 4000, seed: int = 7, multigpu: bool = False) -> list:
    return synergy_trace(
        n, seed=seed, arrival_rate_per_h=9.0, models_by_class=BY_CLASS, multigpu=multigpu
    )


def test_same_seed_same_trace_and_plain_numeric_ids() -> None:
    assert trace(50) == trace(50)
    assert trace(50) != trace(50, seed=8)
    assert [j.job_id for j in trace(5)] == ["0", "1", "2", "3", "4"]


def test_durations_follow_the_two_ranges() -> None:
    durations = [j.duration_s for j in trace()]
    short = [d for d in durations if d < 60 * 10**3]
    # 60 x 10^U(1.5, 3) s for 80 %, 60 x 10^U(3, 4) s for the rest: the bounds hold and
    # the share of short jobs is near 0.8 (seeded, so the count is fixed)
    assert all(60 * 10**1.5 <= d <= 60 * 10**4 for d in durations)
    assert abs(len(short) / len(durations) - 0.8) < 0.02
    exponents = [math.log10(d / 60) for d in short]
    assert abs(statistics.mean(exponents) - 2.25) < 0.03


def test_poisson_arrivals_at_the_rate() -> None:
    jobs = trace()
    assert jobs[0].submit_time == 0.0
    gaps = [b.submit_time - a.submit_time for a, b in pairwise(jobs)]
    assert abs(statistics.mean(gaps) - 3600 / 9) < 20


def test_classes_split_20_70_10_and_round_robin_within_a_class() -> None:
    jobs = trace()
    by_model = Counter(j.model for j in jobs)
    classes = {c: sum(by_model[m] for m in ms) / len(jobs) for c, ms in BY_CLASS.items()}
    assert abs(classes["image"] - 0.2) < 0.02
    assert abs(classes["language"] - 0.7) < 0.02
    assert abs(classes["speech"] - 0.1) < 0.02
    language = [j.model for j in jobs if j.model in BY_CLASS["language"]]
    assert language[:6] == ["l1", "l2", "l3", "l1", "l2", "l3"]


def test_one_gpu_each_unless_multigpu() -> None:
    assert {j.gpus for j in trace(500)} == {1}
    counts = Counter(j.gpus for j in trace(2000, multigpu=True))
    assert set(counts) == {1, 2, 4, 8}
    assert abs(counts[1] / 2000 - 0.7) < 0.03


def test_models_by_class_builtin_without_synergy_data() -> None:
    by_class = synergy_models(ProfilePerformanceModel.builtin())
    assert set(by_class) == {"image", "language", "speech"}
    assert all(by_class.values())


def test_synergy_models_from_the_synergy_file() -> None:
    if not (DATA / "profiles" / "synergy" / "models.json").is_file():
        pytest.skip(f"Synergy's profiles are not shipped ({DATA})")
    by_class = synergy_models(ProfilePerformanceModel.from_data_dir(DATA))
    assert "res50" in by_class["image"] and "deepspeech" in by_class["speech"]


def test_id_ranges() -> None:
    assert parse_id_range("4000-4999") == range(4000, 5000)
    assert parse_id_range("7") == range(7, 8)
    for bad in ("x", "5-4", "-3", "1-b"):
        with pytest.raises(ValueError):
            parse_id_range(bad)
    assert job_number("4000") == 4000 and job_number("syn-12") == 12 and job_number("a") is None
    assert in_id_range("syn-4500", range(4000, 5000)) and not in_id_range("3999", range(4000, 5000))
    assert synergy_count("synergy:10") == 10 and synergy_count("philly.csv") is None
    with pytest.raises(ValueError):
        synergy_count("synergy:0")


def test_measure_ids_limit_the_statistics(tmp_path: Path) -> None:
    def run(*extra: str) -> dict:
        out = tmp_path / ("m" if extra else "all")
        result = CliRunner().invoke(
            app,
            [
                "simulate", "--out", str(out), "--trace", "synergy:60", "--rate", "9",
                "-p", "fifo", "--cluster", "1x8", *extra,
            ],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        return json.loads((out / "summary.json").read_text())["policies"]["fifo"]

    everything = run()
    measured = run("--measure-ids", "20-39")
    assert everything["jobs"] == 60
    assert measured["jobs"] == 20
    assert measured["avg_jct_s"] != everything["avg_jct_s"]
