"""The GPU check: what only a GPU can show, in one bounded command (under 5 minutes).

    python bench/gpu_check.py [--out DIR] [--budget-s 270] [--quick]

Steps, each bounded by what is left of the budget:
1. ``nvml``: the GPUs as the node agent reads them (:class:`Nvml`, opened once), with
   the DCGM-named telemetry fields.
2. ``profile``: iteration time and peak memory of every built-in model at a few batch
   sizes, measured by the worker's own ``--profile`` (the real architectures on a GPU,
   the stand-ins on a CPU), beside the profile figure the policies use. Written as the
   project's measured-profile file for this GPU type (docs/profiles.md).
3. ``colocation``: two real workers on one GPU, alone and together, with and without
   gradient accumulation, beside what ``colocation_slowdown`` predicts.
4. ``live``: ``gpusched up`` with no flags (its node agent over this machine's GPUs),
   three jobs submitted over HTTP with policy sjf-ffs, two of them sharing a GPU.

On a machine without CUDA it runs the same steps on the CPU, with emulated GPUs for the
live step, and says so (the suite runs it that way with ``--quick``). Everything lands
in ``DIR/gpu_check.json`` and a summary is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import print_machine_speed

ROOT = Path(__file__).resolve().parents[1]
#: the worker's variable for real architectures or stand-ins
ARCHITECTURE_ENV = "GPUSCHED_WORKER_ARCHITECTURE"
#: (model, batch sizes) profiled on a GPU; the quick CPU run takes the first batch of each
GPU_PROFILE = {
    "resnet18": (32, 64, 128), "resnet50": (32, 64, 128), "vgg16": (32, 64),
    "inception_v3": (32, 64), "bert": (8, 16, 32), "gpt2": (4, 8),
    "lm": (20, 40), "deepspeech2": (8, 16), "ncf": (256, 1024), "dqn": (32, 128),
    "a2c": (32, 128),
}
CPU_PROFILE = {"resnet18": (4,), "bert": (4,), "ncf": (8,)}
#: the pair that shares a GPU: (model, batch, accumulation steps)
PAIR_A, PAIR_B, PAIR_A_ACCUM = ("resnet50", 64, 1), ("bert", 32, 1), ("resnet50", 64, 4)
CPU_PAIR_A, CPU_PAIR_B, CPU_PAIR_A_ACCUM = ("resnet18", 16, 1), ("bert", 8, 1), ("resnet18", 16, 4)


@dataclass
class Budget:
    deadline: float

    def left(self) -> float:
        return self.deadline - time.monotonic()


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# ---- 1. NVML ----------------------------------------------------------------------------


def step_nvml() -> dict[str, Any]:
    from gpusched.services.nodeagent.gpus import Nvml, nvml_absence

    nvml = Nvml.open()
    if nvml is None:
        return {"gpus": [], "why": nvml_absence()}
    try:
        readings = [nvml.read() or [] for _ in range(3)]
    finally:
        nvml.close()
    last = readings[-1]
    return {
        "gpus": [
            {"index": g.index, "uuid": g.uuid, "name": g.name,
             "memory_total_mib": round(g.memory_total_mib),
             "DCGM_FI_DEV_GPU_UTIL": g.util_percent,
             "DCGM_FI_DEV_FB_USED": round(g.memory_used_mib, 1),
             "DCGM_FI_DEV_FB_FREE": round(g.memory_free_mib, 1),
             "DCGM_FI_DEV_POWER_USAGE": g.power_w, "DCGM_FI_DEV_GPU_TEMP": g.temp_c}
            for g in last
        ],
        "readings": len(readings),
    }


# ---- 2. profiles ------------------------------------------------------------------------


def worker_env(architecture: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env[ARCHITECTURE_ENV] = architecture
    env.update(extra or {})
    return env


def step_profile(device: str, plan: dict[str, tuple[int, ...]], architecture: str,
                 budget: Budget, quick: bool) -> dict[str, Any]:
    from gpusched.libs.core.groundtruth import ProfilePerformanceModel

    truth = ProfilePerformanceModel.builtin()
    models: dict[str, Any] = {}
    for model, batches in plan.items():
        if budget.left() < 20:
            models[model] = {"skipped": f"{budget.left():.0f} s left"}
            continue
        argv = [sys.executable, "-m", "gpusched.services.nodeagent.worker", "--profile",
                "--model", model, "--device", device,
                "--batch-sizes", ",".join(str(b) for b in batches),
                "--warmup", "1" if quick else "3", "--repeats", "2" if quick else "10"]
        try:
            done = subprocess.run(argv, env=worker_env(architecture), capture_output=True,
                                  text=True, timeout=max(10.0, budget.left() - 10))
        except subprocess.TimeoutExpired:
            models[model] = {"error": "timed out"}
            continue
        if done.returncode != 0:
            models[model] = {"error": done.stderr.strip().splitlines()[-1:]}
            continue
        report = json.loads(done.stdout)
        for point in report["results"]:
            with contextlib.suppress(Exception):
                point["profiled_iteration_s"] = truth.iteration_time(
                    model, point["batch_size"], 1, 1
                )
        models[model] = report
    return {"device": device, "architecture": architecture, "models": models}


def measured_profile(profile: dict[str, Any], gpu_name: str, node: str) -> dict[str, Any]:
    """The profile step as the project's measured-profile document (docs/profiles.md)."""
    from gpusched.libs.core.profiles.measured import FORMAT, VERSION, gpu_type_key

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    models = {}
    for model, report in profile["models"].items():
        points = [
            {"batch_size": p["batch_size"], "iteration_s": p["median_iteration_s"],
             "memory_mb": round(p["gpu_mem_mb"], 1)}
            for p in report.get("results", ()) if "median_iteration_s" in p
        ]
        if points:
            models[model] = {"architecture": profile["architecture"],
                             "device": profile["device"], "torch": report.get("torch", ""),
                             "measured_at": now, "node": node, "points": points}
    return {"format": FORMAT, "version": VERSION, "gpu_name": gpu_name,
            "gpu_type": gpu_type_key(gpu_name), "models": models}


# ---- 3. colocation ----------------------------------------------------------------------


class Worker:
    """One built-in worker process with the job contract a node agent gives it."""

    def __init__(self, tag: str, spec: tuple[str, int, int], device: str, base: Path,
                 architecture: str, gpu_uuid: str | None) -> None:
        self.tag = tag
        self.dir = base / tag
        self.dir.mkdir(parents=True)
        self.progress = self.dir / "progress.jsonl"
        model, batch, accum = spec
        env = worker_env(architecture, {
            "GPUSCHED_JOB_ID": tag, "GPUSCHED_RUN_ID": "1", "GPUSCHED_MODEL": model,
            "GPUSCHED_BATCH_SIZE": str(batch), "GPUSCHED_ACCUM_STEPS": str(accum),
            "GPUSCHED_GPUS": "0", "GPUSCHED_DEVICE": device,
            "GPUSCHED_TOTAL_ITERATIONS": "100000000", "GPUSCHED_START_ITERATION": "0",
            "GPUSCHED_CHECKPOINT_DIR": str(self.dir / "ckpt"),
            "GPUSCHED_CHECKPOINT_EVERY": "100000000",
            "GPUSCHED_PROGRESS_FILE": str(self.progress), "GPUSCHED_NODE": "gpu-check",
        })
        if gpu_uuid:
            env["CUDA_VISIBLE_DEVICES"] = gpu_uuid
        self.log = open(self.dir / "run.log", "wb")  # noqa: SIM115 (closed by stop)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpusched.services.nodeagent.worker"], env=env,
            cwd=self.dir, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def lines(self) -> list[dict[str, Any]]:
        found = []
        with contextlib.suppress(OSError):
            for raw in self.progress.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    found.append(json.loads(raw))
        return found

    def wait_ready(self, budget: Budget) -> bool:
        while budget.left() > 5:
            if any(line.get("iteration", 0) >= 2 for line in self.lines()):
                return True
            if self.process.poll() is not None:
                return False
            time.sleep(0.1)
        return False

    def iteration_s(self, since: float, until: float) -> float | None:
        inside = [x for x in self.lines()
                  if x.get("event") == "progress" and since <= x.get("at", 0) <= until]
        if len(inside) < 2 or inside[-1]["iteration"] <= inside[0]["iteration"]:
            return None
        return (inside[-1]["at"] - inside[0]["at"]) / (
            inside[-1]["iteration"] - inside[0]["iteration"])

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        self.log.close()


def step_colocation(device: str, architecture: str, pairs: tuple[Any, Any, Any],
                    budget: Budget, window_s: float, gpu_uuid: str | None) -> dict[str, Any]:
    from gpusched.libs.core.groundtruth import ProfilePerformanceModel
    from gpusched.libs.core.shape import JobShape

    a_spec, b_spec, a_accum_spec = pairs
    base = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    workers: list[Worker] = []
    measured: dict[str, float | None] = {}

    def start(tag: str, spec: tuple[str, int, int]) -> Worker | None:
        worker = Worker(tag, spec, device, base, architecture, gpu_uuid)
        workers.append(worker)
        return worker if worker.wait_ready(budget) else None

    def window(*members: Worker) -> dict[str, float | None]:
        time.sleep(min(1.0, window_s / 3))
        since = time.time()
        time.sleep(window_s)
        until = time.time()
        return {w.tag: w.iteration_s(since, until) for w in members}

    try:
        a = start("A", a_spec)
        if a is not None:
            measured["A_alone"] = window(a)["A"]
            b = start("B", b_spec) if budget.left() > 3 * window_s + 20 else None
            if b is not None:
                together = window(a, b)
                measured["A_with_B"], measured["B_with_A"] = together["A"], together["B"]
                a.stop()
                measured["B_alone"] = window(b)["B"]
                a4 = start("A4", a_accum_spec) if budget.left() > 2 * window_s + 20 else None
                if a4 is not None:
                    together = window(a4, b)
                    measured["A4_with_B"], measured["B_with_A4"] = together["A4"], together["B"]
                    b.stop()
                    measured["A4_alone"] = window(a4)["A4"]
    finally:
        for worker in workers:
            worker.stop()
        shutil.rmtree(base, ignore_errors=True)

    def ratio(x: float | None, y: float | None) -> float | None:
        return round(x / y, 3) if x and y else None

    truth = ProfilePerformanceModel.builtin()
    shape_a, shape_b, shape_a4 = (JobShape(m, b, 1, k) for m, b, k in pairs)
    return {
        "device": device, "architecture": architecture, "window_s": window_s,
        "pair": {"A": a_spec, "B": b_spec, "A4": a_accum_spec},
        "iteration_s": measured,
        "measured_slowdown": {
            "A_by_B": ratio(measured.get("A_with_B"), measured.get("A_alone")),
            "B_by_A": ratio(measured.get("B_with_A"), measured.get("B_alone")),
            "A4_by_B": ratio(measured.get("A4_with_B"), measured.get("A4_alone")),
            "B_by_A4": ratio(measured.get("B_with_A4"), measured.get("B_alone")),
        },
        "predicted_slowdown": {
            "A_by_B": round(truth.colocation_slowdown(shape_a, shape_b), 3),
            "B_by_A": round(truth.colocation_slowdown(shape_b, shape_a), 3),
            "A4_by_B": round(truth.colocation_slowdown(shape_a4, shape_b), 3),
            "B_by_A4": round(truth.colocation_slowdown(shape_b, shape_a4), 3),
        },
    }


# ---- 4. the live system -----------------------------------------------------------------


def http(url: str, token: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                     headers={"Authorization": f"Bearer {token}",
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return dict(json.loads(response.read()))


def run_log_tails(state: Path, lines: int = 15) -> dict[str, list[str]]:
    """The last lines of every job run log under ``state`` (what a failed job said)."""
    tails = {}
    for log in sorted(state.rglob("run-*.log")):
        with contextlib.suppress(OSError):
            text = log.read_text(errors="replace")
            tails[str(log.relative_to(state))] = text.splitlines()[-lines:]
    return tails


def step_live(cuda: bool, budget: Budget, quick: bool, log_path: Path) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="gpu-check-up-"))
    env = {**os.environ, "GPUSCHED_STATE_DIR": str(state)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "gpusched.services.cli.main", "up", "--port", "0",
            "--no-metrics", "--policy", "sjf-ffs", "--state-dir", str(state), "--fresh"]
    if not cuda:
        # the suite's run: no system user made on the machine for it
        argv += ["--emulate-gpus", "1", "--nodes", "1", "--jobs", "process", "--job-user", "self"]
    up_log = log_path.open("wb")
    up = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=up_log,
                          text=True, start_new_session=True)
    result: dict[str, Any] = {"command": " ".join(argv[3:])}
    try:
        assert up.stdout is not None
        banner = []
        for line in up.stdout:
            banner.append(line.rstrip())
            if line.startswith("Ctrl-C"):
                break
        result["banner"] = banner
        found = json.loads((state / "up.json").read_text())
        url, token = found["url"], found["token"]
        iterations = 20 if quick else 300
        jobs = [
            {"name": "first", "model": "resnet18", "batch_size": 32, "iterations": iterations},
            {"name": "sharer", "model": "ncf", "batch_size": 64, "iterations": iterations},
            {"name": "third", "model": "bert", "batch_size": 8, "iterations": iterations},
        ]
        ids = []
        for job in jobs:
            ids.append(http(f"{url}/v1/jobs", token, job)["id"])
            time.sleep(1.0)  # one at a time, so that the first is resident when the next comes
        records: dict[str, dict[str, Any]] = {}
        shared: set[tuple[str, ...]] = set()
        while budget.left() > 10:
            records = {i: http(f"{url}/v1/jobs/{i}", token) for i in ids}
            for record in records.values():
                if record.get("shares_with"):
                    shared.add(tuple(sorted([record["id"], *record["shares_with"]])))
            if all(r["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") for r in records.values()):
                break
            time.sleep(0.5)
        result["cluster"] = http(f"{url}/v1/cluster", token)["nodes"]
        result["jobs"] = [
            {"id": r["id"], "name": r["spec"]["name"], "model": r["spec"]["model"],
             "state": r["state"],
             "placement": r.get("placement"), "accum_steps": r.get("accum_steps"),
             "iterations": r.get("progress", {}).get("iteration"),
             "seconds": round(r["history"][-1]["at"] - r["history"][0]["at"], 1)}
            for r in records.values()
        ]
        result["shared_pairs"] = sorted(shared)
        if any(r["state"] != "SUCCEEDED" for r in records.values()):
            result["run_logs"] = run_log_tails(state)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(up.pid, signal.SIGKILL)
        up_log.close()
        shutil.rmtree(state, ignore_errors=True)
    return result


# ---- the whole check --------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/gpu-check"))
    parser.add_argument("--budget-s", type=float, default=270.0)
    parser.add_argument("--quick", action="store_true",
                        help="one batch per model, short windows (the suite's CPU run)")
    args = parser.parse_args(argv)
    budget = Budget(time.monotonic() + args.budget_s)
    started = time.monotonic()
    print_machine_speed()
    cuda = cuda_available()
    device = "cuda" if cuda else "cpu"
    report: dict[str, Any] = {"device": device, "quick": args.quick}
    if not cuda:
        print("ran without a GPU: no CUDA device here; every step runs on the CPU "
              "(stand-in models, emulated GPUs for the live step)")
    report["nvml"] = step_nvml()
    gpus = report["nvml"]["gpus"]
    print(f"nvml: {len(gpus)} GPU(s) {[g['name'] for g in gpus]}"
          + ("" if gpus else f" ({report['nvml']['why']})"))
    architecture = "real" if cuda else "stand-in"
    plan = GPU_PROFILE if cuda else CPU_PROFILE
    if args.quick:
        plan = {m: b[:1] for m, b in plan.items()}
    # the profiles may take under half the budget: the sharing and live steps need theirs
    profile_budget = Budget(min(budget.deadline, time.monotonic() + 0.45 * args.budget_s))
    report["profile"] = step_profile(device, plan, architecture, profile_budget, args.quick)
    for model, entry in report["profile"]["models"].items():
        for point in entry.get("results", ()):
            print(f"profile {model} batch {point['batch_size']}: "
                  f"{1000 * point.get('median_iteration_s', float('nan')):.1f} ms, "
                  f"{point.get('gpu_mem_mb', float('nan')):.0f} MiB "
                  f"(profiled {1000 * point.get('profiled_iteration_s', float('nan')):.1f} ms)")
    gpu_name = gpus[0]["name"] if gpus else f"CPU {os.cpu_count()} cores"
    document = measured_profile(report["profile"], gpu_name, "gpu-check")
    args.out.mkdir(parents=True, exist_ok=True)
    profile_file = args.out / f"measured-{document['gpu_type']}.json"
    profile_file.write_text(json.dumps(document, indent=2) + "\n")
    report["profile_file"] = str(profile_file)
    pairs = (PAIR_A, PAIR_B, PAIR_A_ACCUM) if cuda else (CPU_PAIR_A, CPU_PAIR_B, CPU_PAIR_A_ACCUM)
    window = 1.5 if args.quick else 5.0
    report["colocation"] = step_colocation(
        device, architecture, pairs, budget, window, gpus[0]["uuid"] if cuda and gpus else None
    )
    print(f"colocation measured {report['colocation']['measured_slowdown']}")
    print(f"colocation predicted {report['colocation']['predicted_slowdown']}")
    report["live"] = step_live(cuda, budget, args.quick, args.out / "up.log")
    for job in report["live"].get("jobs", ()):
        print(f"live {job['name']} ({job['model']}): {job['state']} on {job['placement']} "
              f"in {job['seconds']} s")
    print(f"live shared pairs: {report['live'].get('shared_pairs')}")
    report["wall_s"] = round(time.monotonic() - started, 1)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wall {report['wall_s']} s; report {args.out / 'gpu_check.json'}; "
          f"measured profile {profile_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
