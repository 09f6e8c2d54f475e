"""Checking the options of ``gpusched simulate`` and turning them into the runner's inputs.

A mistake found here raises :class:`UsageError`, or an error of the runner, the trace
reader or the policies (`_user_errors` lists them all); the command shows it as one line
with exit code 2, before a long trace load where it can. The runner, the policies and
the workload helpers are imported inside the functions that use them, so that the command
line starts without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:
    from gpusched.libs.core.cluster import Cluster
    from gpusched.libs.core.jobs import JobSpec
    from gpusched.libs.core.perf import PerformanceModel
    from gpusched.services.scheduler.simulation.results import SimResult
    from gpusched.services.scheduler.simulation.runner import Workload

DEFAULT_CLUSTER = "64x8"


class UsageError(ValueError):
    """A mistake in the options, found by the command line itself."""


def _user_errors() -> tuple[type[Exception], ...]:
    """Mistakes in what the user asked for: shown as one line, exit code 2."""
    from gpusched.libs.core.extras import MissingExtraError
    from gpusched.libs.core.perf import UnknownModelError
    from gpusched.libs.core.traces import TraceError
    from gpusched.services.scheduler.policies import UnknownPolicyError
    from gpusched.services.scheduler.simulation.runner import InputError

    return (UsageError, InputError, TraceError, UnknownPolicyError, UnknownModelError,
            MissingExtraError)  # fmt: skip


def _trace_source(trace: str | None, synthetic_jobs: int | None) -> str:
    from gpusched.services.scheduler.simulation.runner import SYNTHETIC_PREFIX

    if trace is not None and synthetic_jobs is not None:
        raise UsageError("give --trace or --synthetic, not both")
    if synthetic_jobs is not None:
        return f"{SYNTHETIC_PREFIX}{synthetic_jobs}"
    if trace is None:
        raise UsageError(f"give --trace PATH (or {SYNTHETIC_PREFIX}N) or --synthetic N")
    return trace


def _synergy_workload(
    source: str, perf: PerformanceModel, seed: int, rate: float, multigpu: bool, cluster: Cluster
) -> Workload | None:
    """Synergy's generated workload for ``synergy:N``, None for any other trace."""
    from gpusched.libs.core.workload import synergy_count, synergy_jobs
    from gpusched.services.scheduler.simulation.runner import Workload

    try:
        count = synergy_count(source)
        if count is None:
            return None
        jobs, note = synergy_jobs(
            count, perf, seed=seed, arrival_rate_per_h=rate, multigpu=multigpu, cluster=cluster
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return Workload(jobs, [note])


def _check_opt_bound(cluster: Cluster) -> None:
    cpus = sum(n.cpus for n in cluster.nodes)
    mem = sum(n.host_mem_gb for n in cluster.nodes)
    if not (cpus > 0 and mem > 0):
        raise UsageError(
            f"--opt-bound divides the cluster's CPUs and host memory, and it has "
            f"{cpus:g} CPUs and {mem:g} GB; give nodes some (--cpus-per-node, --mem-gb-per-node)"
        )


def _measure_ids(spec: str | None) -> range | None:
    from gpusched.libs.core.workload import parse_id_range

    try:
        return None if spec is None else parse_id_range(spec)
    except ValueError as exc:
        raise UsageError(f"--measure-ids: {exc}") from None


def _slack(spec: str | None) -> tuple[float, float] | None:
    from gpusched.libs.core.workload import parse_slack_range

    try:
        return None if spec is None else parse_slack_range(spec)
    except ValueError as exc:
        raise UsageError(f"--deadlines: {exc}") from None


def _measured(result: SimResult, ids: range) -> SimResult:
    from dataclasses import replace

    from gpusched.libs.core.workload import in_id_range

    return replace(result, jobs=tuple(j for j in result.jobs if in_id_range(j.job_id, ids)))


def _cluster_spec(cluster: str | None, nodes_file: Path | None) -> str:
    if nodes_file is not None and cluster is not None:
        raise UsageError("give --cluster or --nodes-file, not both")
    if nodes_file is not None:
        if not nodes_file.is_file():
            raise UsageError(f"node list not found: {nodes_file}")
        return str(nodes_file)
    return cluster or DEFAULT_CLUSTER


def _build_cluster(
    spec: str, data_dir: Path | None, cpus_per_node: int | None, mem_gb_per_node: float | None
) -> Cluster:
    """The runner's cluster of ``spec``, or the cluster file (.json) it names."""
    from gpusched.services.scheduler.simulation.runner import build_cluster, check_host_resources

    if not spec.strip().lower().endswith(".json"):
        return build_cluster(spec, data_dir, cpus_per_node, mem_gb_per_node)
    from gpusched.libs.core.cluster_file import ClusterFileError, load_cluster_file

    check_host_resources(cpus_per_node, mem_gb_per_node)
    try:
        cluster = load_cluster_file(spec.strip())
    except ClusterFileError as exc:
        raise UsageError(f"--cluster: {exc}") from None
    if cpus_per_node is None and mem_gb_per_node is None:
        return cluster
    return cluster.with_host_resources(cpus_per_node, mem_gb_per_node)


def _check_out(out: Path) -> None:
    # before any run: an unusable folder would otherwise be found only after all of them
    from gpusched.services.scheduler.simulation.report import output_problem

    problem = output_problem(out)
    if problem:
        raise UsageError(f"--out {out}: {problem}")


def _parse_mix(mix: str | None) -> dict[str, float] | None:
    if mix is None:
        return None
    from gpusched.libs.core.workload import parse_mix

    try:
        return parse_mix(mix)
    except ValueError as exc:
        raise UsageError(f"--mix: {exc}") from None


def _with_extras(names: list[str], explicit: bool, notes: Console) -> list[str]:
    """The policies whose optional dependencies are installed. A policy named with
    --policy that lacks one stops the run before the trace loads (`MissingExtraError`
    names the extra); one that only came with the default list of all is left out,
    with a note."""
    from gpusched.libs.core.extras import TRAIN, MissingExtraError, require
    from gpusched.services.scheduler.policies import make_policy

    kept = []
    for name in names:
        try:
            if make_policy(name).capabilities.predicts_progress:
                require("torch", TRAIN, f"policy {name} (its progress predictor)")
        except MissingExtraError as exc:
            if explicit:
                raise
            notes.print(Text(f"left out: {exc}", style="dim"), soft_wrap=True)
            continue
        kept.append(name)
    return kept


def _honouring_priorities(
    names: list[str], jobs: Sequence[JobSpec], explicit: bool, notes: Console
) -> list[str]:
    """With jobs that carry a priority, a policy that cannot honour one named with
    --policy stops the run (naming the field), and one that came with the default list
    of all is left out with a note."""
    from gpusched.services.scheduler.policies import honours_priority, make_policy
    from gpusched.services.scheduler.simulation.runner import InputError

    if not any(job.priority for job in jobs):
        return names
    kept = []
    for name in names:
        if honours_priority(make_policy(name)):
            kept.append(name)
            continue
        problem = (
            f"priority: policy {name} does not honour priorities (it re-plans every job's "
            "size) and the trace gives some jobs one"
        )
        if explicit:
            raise InputError(problem)
        notes.print(Text(f"left out: {problem}", style="dim"), soft_wrap=True)
    return kept


def _policy_names(policy: list[str] | None) -> list[str]:
    # split "a,b" too: users type lists both ways
    return [p for item in policy or [] for p in item.split(",") if p.strip()]
