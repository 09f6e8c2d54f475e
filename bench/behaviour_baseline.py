"""What every policy decides on a fixed Philly replay, to show that a change of code
leaves decisions as they were.

Replays the first 20,000 Philly jobs on 64x8 GPUs (seed 0) through every policy but
``ones`` and the first 1,000 through ``ones`` (its genetic search is far slower), the
workload ``gpusched simulate --trace .../philly.csv --format philly --limit N`` runs,
and writes per policy what its summary holds (average JCT to the cent, median, p99,
queueing, makespan, utilisation, preemptions, shared pairs, resizes, decisions, ...)
plus a digest of every job's outcome to a JSON file. With ``--check FILE`` it compares
the new run to a stored one, prints every difference and exits 1 if there is any.

    python bench/behaviour_baseline.py --out /tmp/before.json
    python bench/behaviour_baseline.py --check /tmp/before.json [--policy sjf-bsbf ...]

A run takes several minutes on a 2-core machine; ``--workers N`` replays N policies at a
time (default: the cores; bench/parallel.py), with the same figures. Wall times are
printed, never compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from parallel import add_options, run_all  # bench/ is the script's own directory
from speed import print_machine_speed

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.perf import PerformanceModel
from gpusched.services.scheduler.policies import POLICIES
from gpusched.services.scheduler.simulation.results import SimResult
from gpusched.services.scheduler.simulation.runner import build_cluster, build_models, load_workload
from gpusched.services.scheduler.simulation.sweep import SimRun

JOBS = 20_000
#: ``ones`` replays fewer jobs: 500 Philly jobs take it minutes
ONES_JOBS = 1_000
#: summary figures in seconds, compared to the cent
SECONDS = ("avg_jct_s", "p50_jct_s", "p99_jct_s", "avg_queue_s", "makespan_s")
#: summary entries that measure the machine, not the decisions
IGNORED = ("wall_s",)


def record(result: SimResult) -> dict[str, Any]:
    """What a run decided: its summary (seconds to the cent), its resizes and a digest
    of every job's start, finish, preemptions and sharing."""
    figures: dict[str, Any] = {}
    for key, value in result.summary().items():
        if key in IGNORED:
            continue
        if key in SECONDS or key == "gpu_util":
            value = _rounded(value, 2 if key in SECONDS else 6)
        figures[key] = value
    figures["resizes"] = result.resizes
    figures["outcomes_sha256"] = digest(result)
    return figures


def digest(result: SimResult) -> str:
    lines = hashlib.sha256()
    for job in result.jobs:
        lines.update(
            f"{job.job_id} {job.state} {_rounded(job.start_time, 3)} "
            f"{_rounded(job.finish_time, 3)} {job.preemptions} {job.shared}\n".encode()
        )
    return lines.hexdigest()


def _rounded(value: float | None, places: int) -> float | str | None:
    if value is None:
        return None
    if math.isnan(value):
        return "nan"
    return round(value, places)


def load(data_dir: str, cluster: Cluster, perf: PerformanceModel, limit: int) -> list[JobSpec]:
    trace = Path(data_dir) / "traces" / "philly" / "philly.csv"
    return load_workload(
        trace, "philly", perf, seed=0, data_dir=data_dir, limit=limit, cluster=cluster
    ).jobs


def run(data_dir: str, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    cluster = build_cluster("64x8", data_dir)
    truth, estimates = build_models(data_dir, seed=0)
    workloads: dict[int, list[JobSpec]] = {}
    runs = []
    for name in names:
        limit = ONES_JOBS if name == "ones" else JOBS
        if limit not in workloads:
            workloads[limit] = load(data_dir, cluster, truth, limit)
        runs.append(SimRun(name, cluster, workloads[limit], name, truth, estimates))
    figures: dict[str, Any] = {}
    for run, result in zip(runs, run_all(runs, args), strict=True):
        name = run.label
        figures[name] = {"jobs_replayed": run.total, **record(result)}
        summary = figures[name]
        print(
            f"{name:<14} {run.total:>6} jobs  wall {result.wall_s:>7.1f} s  "
            f"avg JCT {summary['avg_jct_s']:>12} s  preempt {summary['preemptions']:>6}  "
            f"shared {summary['shared_pairs']:>6}  resizes {summary['resizes']:>5}",
            flush=True,
        )
    return {"cluster": "64x8", "seed": 0, "policies": figures}


def differences(stored: dict[str, Any], new: dict[str, Any]) -> list[str]:
    found: list[str] = []
    old_policies, new_policies = stored["policies"], new["policies"]
    for name in sorted(set(old_policies) | set(new_policies)):
        if name not in new_policies:
            continue  # not run this time (--policy)
        if name not in old_policies:
            found.append(f"{name}: not in the stored run")
            continue
        before, after = old_policies[name], new_policies[name]
        for key in sorted(set(before) | set(after)):
            if before.get(key) != after.get(key):
                found.append(f"{name}: {key} {before.get(key)!r} -> {after.get(key)!r}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data")
    )
    parser.add_argument("--policy", action="append", choices=sorted(POLICIES))
    parser.add_argument("--out", help="write the figures to this JSON file")
    parser.add_argument("--check", help="compare with the figures stored in this JSON file")
    add_options(parser)
    args = parser.parse_args()
    print_machine_speed()
    if not (Path(args.data_dir) / "traces" / "philly" / "philly.csv").exists():
        print(f"skipped: no traces/philly/philly.csv under {args.data_dir}")
        sys.exit(0)
    began = time.perf_counter()
    names = args.policy or list(POLICIES)
    stored = json.loads(Path(args.check).read_text()) if args.check else None
    if stored is not None and not args.policy:
        # a policy added since the stored run has nothing to be compared with
        new = [n for n in names if n not in stored["policies"]]
        if new:
            print(f"not compared, not in {args.check}: {', '.join(new)}")
        names = [n for n in names if n in stored["policies"]]
    figures = run(args.data_dir, names, args)
    print(f"all runs: {time.perf_counter() - began:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.out}")
    if args.check:
        assert stored is not None
        found = differences(stored, figures)
        for line in found:
            print(f"DIFFERENT {line}")
        checked = ", ".join(figures["policies"])
        print(f"check against {args.check}: {len(found)} difference(s) over {checked}")
        sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
