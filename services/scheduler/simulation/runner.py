"""Running a set of policies on one workload: the orchestration behind ``gpusched simulate``.

Kept free of any CLI so tests and benchmarks drive the same path:
`build_cluster` -> `load_workload` -> `build_models` -> `run_policies`.
User mistakes (a bad cluster spec, an unknown model in a trace, ...) surface as
`InputError`, `TraceError`, `UnknownPolicyError` or `UnknownModelError`, each with a
message fit to show as is.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpusched.libs.core.cluster import Cluster
from gpusched.libs.core.groundtruth import SPEED_MODELS, NoisyEstimates, load_performance_model
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.measured import read_over
from gpusched.libs.core.mixed import mixed_jobs, mixed_spec
from gpusched.libs.core.perf import PerformanceModel
from gpusched.libs.core.recurring import recurring_count, recurring_jobs
from gpusched.libs.core.size_predictor import PREDICTORS
from gpusched.libs.core.traces import LoadedTrace, TraceJob, load_alibaba_nodes, load_trace
from gpusched.libs.core.workload import materialize, synthetic
from gpusched.services.scheduler.policies import (
    POLICIES,
    RESIDENT_CAP_POLICIES,
    make_policy,
)
from gpusched.services.scheduler.policies.sjf_bsbf import resident_cap_problem
from gpusched.services.scheduler.simulation.results import SimResult
from gpusched.services.scheduler.simulation.simulator import SimConfig
from gpusched.services.scheduler.simulation.sweep import (
    Interrupted as Interrupted,  # where callers of run_policies have always found it
)
from gpusched.services.scheduler.simulation.sweep import RunFailed, SimRun, sweep

if TYPE_CHECKING:
    from gpusched.services.scheduler.simulation.sweep import Executor

#: ``--cluster alibaba`` reads this node list inside the data folder
ALIBABA_NODES = Path("traces/alibaba-v2023/openb_node_list_gpu_node.csv")
#: Largest ``--prediction-error``: a log-normal sigma beyond it tells a policy nothing
#: more, and its factors leave the range of floating-point numbers
MAX_PREDICTION_ERROR = 10.0
#: ``--trace synthetic:N`` asks for N generated jobs instead of a file
SYNTHETIC_PREFIX = "synthetic:"

ProgressCallback = Callable[[int, int], None]
ProgressFactory = Callable[[str, int], ProgressCallback]
#: called with each policy's result as soon as its run ends
FinishedCallback = Callable[[SimResult], None]


class InputError(ValueError):
    """A user-supplied setting or workload that cannot be used; the message says why."""


@dataclass
class Workload:
    jobs: list[JobSpec]
    #: where the jobs came from, one line each: the file and its counts, or the generator
    notes: list[str] = field(default_factory=list)
    skipped_rows: int = 0


# ---------------------------------------------------------------------------- cluster


def build_cluster(
    spec: str,
    data_dir: str | Path | None,
    cpus_per_node: int | None = None,
    mem_gb_per_node: float | None = None,
) -> Cluster:
    """``NODESxGPUS`` (``64x8``), ``alibaba`` (the Alibaba node list in ``data_dir``)
    or the path of an Alibaba-style node list CSV; every node then gets
    ``cpus_per_node`` CPU cores and ``mem_gb_per_node`` GB of host memory where given."""
    check_host_resources(cpus_per_node, mem_gb_per_node)
    cluster = _parse_cluster(spec, data_dir)
    if cpus_per_node is None and mem_gb_per_node is None:
        return cluster
    return cluster.with_host_resources(cpus_per_node, mem_gb_per_node)


def check_host_resources(cpus_per_node: int | None, mem_gb_per_node: float | None) -> None:
    if cpus_per_node is not None and not cpus_per_node > 0:
        raise InputError(f"--cpus-per-node {cpus_per_node}: expected a number of CPUs > 0")
    if mem_gb_per_node is not None and not (mem_gb_per_node > 0 and math.isfinite(mem_gb_per_node)):
        raise InputError(f"--mem-gb-per-node {mem_gb_per_node:g}: expected gigabytes > 0")


def check_round_s(round_s: float | None) -> None:
    if round_s is not None and not (round_s > 0 and math.isfinite(round_s)):
        raise InputError(f"--round-s {round_s:g}: expected seconds > 0")


def _parse_cluster(spec: str, data_dir: str | Path | None) -> Cluster:
    text = spec.strip()
    if text.lower() == "alibaba":
        if data_dir is None:
            raise InputError("--cluster alibaba reads the node list from --data-dir; give one")
        return load_alibaba_nodes(Path(data_dir) / ALIBABA_NODES)
    if re.fullmatch(r"\d+\s*[xX]\s*\d+", text) or (
        re.match(r"\d+\s*[xX]\s*\d+\s*[:,]", text) and not Path(text).is_file()
    ):
        try:  # NODESxGPUS, or groups NODESxGPUS:TYPE,... of several GPU types
            return Cluster.parse(text)
        except ValueError as exc:  # e.g. 0x8: well-formed but empty, or too large
            raise InputError(f"bad cluster spec {spec!r} (--cluster): {exc}") from None
    if text.lower().endswith(".csv") or Path(text).is_file():
        return load_alibaba_nodes(text)
    raise InputError(
        f"bad cluster spec {spec!r}: expected NODESxGPUS (e.g. 64x8), groups of one GPU "
        "type each (e.g. 8x4:V100,16x4:K80), 'alibaba', or a node list .csv"
    )


# ---------------------------------------------------------------------------- workload


def synthetic_count(trace: str) -> int | None:
    """N for ``synthetic:N``, None for a file path."""
    if not trace.startswith(SYNTHETIC_PREFIX):
        return None
    text = trace[len(SYNTHETIC_PREFIX) :]
    if not text.isdigit() or int(text) < 1:
        raise InputError(f"--trace {trace!r}: expected synthetic:N with N >= 1 jobs")
    return int(text)


def load_workload(
    trace: str | Path,
    fmt: str | None,
    perf: PerformanceModel,
    *,
    seed: int = 0,
    data_dir: str | Path | None = None,
    skip_bad_rows: bool = False,
    limit: int | None = None,
    rate_per_h: float = 10.0,
    mix: Mapping[str, float] | None = None,
    cluster: Cluster | None = None,
) -> Workload:
    """Read (or, for ``synthetic:N``, ``recurring:N`` and ``mixed:N``, generate) trace
    jobs and make them runnable on ``cluster``: a job given a run time takes that long
    alone there (see `materialize`; without a cluster, on 8-GPU nodes)."""
    _check_mix(mix, perf)
    try:
        recurring = recurring_count(str(trace))
        if recurring is not None:
            n = recurring if limit is None else min(recurring, limit)
            jobs, line = recurring_jobs(
                n, perf, seed=seed, arrival_rate_per_h=rate_per_h, cluster=cluster
            )
            return Workload(jobs, [line])
        mixed = _mixed_workload(str(trace), perf, seed, rate_per_h, limit, cluster)
        if mixed is not None:
            return mixed
    except ValueError as exc:
        raise InputError(str(exc)) from None
    count = synthetic_count(str(trace))
    if count is not None:
        n = count if limit is None else min(count, limit)
        generated = _generate(n, seed, rate_per_h, mix)
        note = f"synthetic: {n} jobs, Poisson arrivals at {rate_per_h:g}/h, seed {seed}"
        return Workload(_materialize(generated, perf, seed, mix, cluster), [note])
    if fmt is None:
        raise InputError("--format is required with a trace file")
    loaded: LoadedTrace = load_trace(
        trace, fmt, skip_bad_rows=skip_bad_rows, data_dir=data_dir, limit=limit
    )
    specs = _materialize(loaded.jobs, perf, seed, mix, cluster)
    return Workload(specs, loaded.notes, loaded.skipped_rows)


def _mixed_workload(
    trace: str,
    perf: PerformanceModel,
    seed: int,
    rate_per_h: float,
    limit: int | None,
    cluster: Cluster | None,
) -> Workload | None:
    """The mixed workload of ``mixed:N[,KEY=VALUE...]`` (`gpusched.libs.core.mixed`),
    None for any other trace; at ``load=`` where it sets one, else at ``rate_per_h``."""
    found = mixed_spec(trace)
    if found is None:
        return None
    count, config = found
    if cluster is None:
        raise InputError(f"--trace {trace!r}: a mixed workload is drawn for a cluster; give one")
    n = count if limit is None else min(count, limit)
    jobs, line = mixed_jobs(n, perf, cluster, seed=seed, arrival_rate_per_h=rate_per_h,
                            config=config)  # fmt: skip
    notes = [line]
    if config.load is not None:
        notes.append("the arrival rate follows load=, not --rate")
    return Workload(jobs, notes)


def _check_mix(mix: Mapping[str, float] | None, perf: PerformanceModel) -> None:
    # checked here so the message names the mix, not the first job that drew the model
    unknown = sorted(set(mix or ()) - set(perf.models()))
    if unknown:
        raise InputError(
            f"the model mix names unknown model(s) {', '.join(unknown)}; "
            f"valid models: {', '.join(sorted(perf.models()))}"
        )


def _generate(
    n: int, seed: int, rate_per_h: float, mix: Mapping[str, float] | None
) -> list[TraceJob]:
    try:
        return synthetic(n, seed=seed, arrival_rate_per_h=rate_per_h, mix=mix)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def _materialize(
    jobs: Sequence[TraceJob],
    perf: PerformanceModel,
    seed: int,
    mix: Mapping[str, float] | None,
    cluster: Cluster | None,
) -> list[JobSpec]:
    # materialize raises ValueError only for what the trace or mix says (unknown model)
    try:
        return materialize(jobs, perf, seed=seed, mix=mix, cluster=cluster)
    except ValueError as exc:
        raise InputError(str(exc)) from None


# ---------------------------------------------------------------------------- models


def build_models(
    data_dir: str | Path | None,
    prediction_error: float = 0.0,
    seed: int = 0,
    speed_model: str = "grid",
    profiles: str | Path | None = None,
) -> tuple[PerformanceModel, PerformanceModel | None]:
    """Ground truth from ``data_dir`` (built-in profiles when None) with its CPU/memory
    ``speed_model`` (see `SPEED_MODELS`), timing the models of the measured profile file
    ``profiles`` from its figures (libs/core/measured.py), and, when
    ``prediction_error`` > 0, estimates that err by that log-normal sigma."""
    if speed_model not in SPEED_MODELS:
        raise InputError(
            f"--speed-model {speed_model!r}: expected one of {', '.join(SPEED_MODELS)}"
        )
    if not 0 <= prediction_error <= MAX_PREDICTION_ERROR:
        raise InputError(
            f"--prediction-error {prediction_error:g}: expected a log-normal sigma from 0 "
            f"to {MAX_PREDICTION_ERROR:g} (at {MAX_PREDICTION_ERROR:g}, one standard "
            f"deviation already misjudges a model {math.exp(MAX_PREDICTION_ERROR):,.0f}-fold)"
        )
    truth: PerformanceModel
    try:
        truth = load_performance_model(data_dir, speed_model)
    except (OSError, ValueError) as exc:  # missing data folder, malformed profile file
        raise InputError(str(exc)) from None
    if profiles is not None:
        try:
            truth = read_over(truth, profiles)
        except ValueError as exc:  # missing, unreadable, or of no known model
            raise InputError(f"--profiles: {exc}") from None
    if prediction_error == 0:
        return truth, None  # the simulator then lets the policy see the truth
    return truth, NoisyEstimates(truth, sigma=prediction_error, seed=seed)


def check_predictor(predictor: str) -> None:
    """``--predictor``: the sizes the policies believe (see `SimConfig.predictor`)."""
    if predictor not in PREDICTORS:
        raise InputError(f"--predictor {predictor!r}: expected one of {', '.join(PREDICTORS)}")


# ---------------------------------------------------------------------------- runs


def check_policies(
    policy_names: Sequence[str], max_resident_slowdown: float | None = None
) -> list[str]:
    """Validate names (and a resident slowdown cap) before any run starts, so a typo
    fails in seconds, not hours."""
    for name in policy_names:
        make_policy(name)  # raises UnknownPolicyError listing the valid names
    names = [n.strip().lower() for n in policy_names] or list(POLICIES)
    if max_resident_slowdown is not None:
        problem = resident_cap_problem(max_resident_slowdown)
        if problem:
            raise InputError(f"max resident slowdown: {problem}")
        if not set(names) & set(RESIDENT_CAP_POLICIES):
            raise InputError(
                "a max resident slowdown applies to the policies that share GPUs "
                f"({', '.join(RESIDENT_CAP_POLICIES)}); none of them is selected"
            )
    return list(dict.fromkeys(names))  # a policy named twice runs once


def run_policies(
    jobs: Sequence[JobSpec],
    cluster: Cluster,
    policy_names: Sequence[str],
    truth: PerformanceModel,
    estimates: PerformanceModel | None = None,
    config: SimConfig | None = None,
    progress_factory: ProgressFactory | None = None,
    max_resident_slowdown: float | None = None,
    *,
    on_finished: FinishedCallback | None = None,
    opt_bound: bool = False,
    workers: int = 1,
    executor: Executor | None = None,
) -> list[SimResult]:
    """Simulate ``jobs`` under each policy (all of `POLICIES` when none are named).

    ``progress_factory(policy, n_jobs)`` returns the progress callback for that run;
    ``on_finished(result)`` hears of each run as it ends; ``max_resident_slowdown`` goes
    to the policies that share GPUs; with ``opt_bound`` each policy runs wrapped in
    `OptBounded` and its result carries the Synergy-OPT bound over the run. ``workers``
    runs at a time on ``executor`` (`sweep`); the results come in the order of the
    names whatever order the runs end in. Ctrl-C raises `Interrupted` with the results
    of the runs that had ended.
    """
    names = check_policies(policy_names, max_resident_slowdown)
    runs = [
        SimRun(name, cluster, jobs, name, truth, estimates, config, max_resident_slowdown,
               opt_bound)
        for name in names
    ]  # fmt: skip
    try:
        return sweep(runs, workers, executor, progress_factory, on_finished)
    except RunFailed as exc:
        # callers catch what the run itself raised (PolicyViolation, UnknownModelError,
        # ...); its cause is the worker's traceback where it ran in another process
        raise exc.error from exc.error.__cause__


# ---------------------------------------------------------------------------- estimates


#: Simulated jobs per wall second of each policy on the first 10,000 jobs of the Philly
#: trace on 64 x 8 GPUs (the demo's run), on the 2-core development machine at
#: machine_speed_s 0.57 (docs/results.md, "The demo's run time"); `estimate_s` reads
#: them. A busier machine is slower: at machine_speed_s 0.95 to 1.56 the same run took
#: three times as long.
POLICY_RATES: dict[str, float] = {
    "fifo": 4_800,
    "fifo-backfill": 5_300,
    "sjf": 5_900,
    "edf": 5_000,
    "genie": 2_300,
    "srtf": 1_300,
    "tiresias": 1_550,
    "asrpt": 1_450,
    "sjf-ffs": 1_300,
    "sjf-bsbf": 1_500,
    "synergy-fifo": 1_650,
    "synergy-srtf": 1_950,
    "synergy-las": 1_900,
    # its genetic search costs more than any queue scan, even at one generation per
    # search interval: the first 1,000 Philly jobs took 461 s at machine_speed_s 1.6-3.1
    # (about 10 jobs/s at 0.57); the demo gives it a slice of 1,000 jobs
    "ones": 5,
    # a decision that preempts runs genie twice: 10,000 Philly jobs took 47.6 s against
    # genie's 6.4 s on a busy machine
    "auto": 300,
}
#: a policy missing from ``POLICY_RATES``: the slowest rate there but ones's
SLOWEST_RATE = 1_300.0


def estimate_s(policy_names: Sequence[str], n_jobs: int) -> float:
    """About how many wall seconds `run_policies` takes for ``n_jobs`` jobs under these
    policies on the development machine (see ``POLICY_RATES``)."""
    return sum(n_jobs / POLICY_RATES.get(name, SLOWEST_RATE) for name in policy_names)
