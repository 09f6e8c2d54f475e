"""``auto``'s rules 6 and 7 (see ``auto.py``): each start on the GPU type where its job
gains most, and CPU and memory after Synergy's TUNE. Pure functions of a snapshot and
the decision rules 1-5 took on it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from gpusched.libs.core.cluster import HOST_SLACK, Cluster, HostUse
from gpusched.libs.core.decision import Decision, Reallocate, Resize, Start
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.libs.core.type_speed import TypeSpeeds
from gpusched.services.scheduler.policies.synergy import best_case


def on_fastest_types(snapshot: Snapshot, decision: Decision, speeds: TypeSpeeds) -> Decision:
    """``decision`` with its starts moved, within the GPUs they and the idle ones hold,
    each to the fastest type with room for it, those that gain most first (rule 6)."""
    cluster = snapshot.cluster
    movable: list[tuple[Start, JobView]] = []
    kept: list[Start] = []
    for start in decision.starts:
        job = snapshot.job(start.job_id)
        if (
            start.shares_with
            or start.batch_size is not None
            or job.tensor_parallel > 1
            or job.pipeline_parallel > 1
        ):
            kept.append(start)
        else:
            movable.append((start, job))
    if not movable:
        return decision
    held = {g for s in kept for g in s.gpu_ids}
    pool: dict[int, list[int]] = {}  # node -> its pooled GPUs
    for start, _ in movable:
        for gpu in start.gpu_ids:
            pool.setdefault(cluster.gpu_node[gpu], []).append(gpu)
    for gpu, residents in enumerate(snapshot.gpu_load):
        if residents == 0 and gpu not in held:
            pool.setdefault(cluster.gpu_node[gpu], []).append(gpu)
    pool = {node: sorted(set(gpus)) for node, gpus in pool.items()}
    kinds = range(len(cluster.gpu_types))
    ranked = []
    for start, job in movable:
        sub_batch = job.batch_size / (len(start.gpu_ids) * max(1, start.accum_steps))
        by_kind = {k: speeds.speed(job.model, sub_batch, k) for k in kinds}
        gain = max(by_kind.values()) / min(by_kind.values())
        ranked.append((-gain, job.job_id, start, job, sub_batch, by_kind))
    ranked.sort(key=lambda r: (r[0], r[1]))
    moved: list[Start] = []
    for _, _, start, job, sub_batch, by_kind in ranked:
        memory = snapshot.estimates.gpu_memory_mb(job.model, sub_batch)
        size = len(start.gpu_ids)
        taken: list[int] | None = None
        for kind in sorted(kinds, key=lambda k: (-by_kind[k], k)):
            nodes = [
                n for n, gpus in pool.items()
                if gpus and cluster.node_type[n] == kind
                and cluster.nodes[n].gpu_mem_mb >= memory
            ]
            taken = _fewest_nodes(pool, nodes, size)
            if taken is not None:
                break
        if taken is None:
            return decision
        moved.append(replace(start, gpu_ids=tuple(sorted(taken))))
    order = {s.job_id: i for i, s in enumerate(decision.starts)}
    starts = sorted((*kept, *moved), key=lambda s: order[s.job_id])
    return replace(decision, starts=tuple(starts))


def with_cpu_mem(snapshot: Snapshot, decision: Decision) -> Decision:
    """``decision`` with its starts given CPU and memory (rule 7), the jobs above their
    share lowered where its resizes and starts need the room, and its resizes in an
    order in which each fits when it is applied."""
    cluster = snapshot.cluster
    holders = _share_holders(snapshot, decision)

    def before_changes() -> HostUse:
        host = HostUse(cluster, snapshot.node_cpus_used, snapshot.node_mem_used, holders)
        for preempt in decision.preemptions:
            gone = snapshot.job(preempt.job_id)
            host.add(gone.gpu_ids, gone.cpus, gone.mem_gb, -1)
        return host

    host = before_changes()
    for resize in decision.resizes:
        was = snapshot.job(resize.job_id)
        host.add(was.gpu_ids, was.cpus, was.mem_gb, -1)
        host.add(resize.gpu_ids, None, None, 1)
    for start in decision.starts:
        if start.shares_with and start.cpus is None and start.mem_gb is None:
            # a resident with an allocation of its own leaves the GPU's share uncounted
            host.add(start.gpu_ids, *cluster.proportional_share(start.gpu_ids), 1)
        else:
            host.add(start.gpu_ids, start.cpus, start.mem_gb, 1)
    moved = {p.job_id for p in decision.preemptions} | {r.job_id for r in decision.resizes}
    lowered: dict[str, Reallocate] = {}
    # a resize takes its new GPUs' share as a start does (ONES sizes by GPUs alone)
    touched = {cluster.gpu_node[g] for s in decision.starts for g in s.gpu_ids}
    touched.update(cluster.gpu_node[g] for r in decision.resizes for g in r.gpu_ids)
    for node in sorted(touched):
        if not _over(host, cluster, node):
            continue
        above_share = sorted(
            (j for j in snapshot.running
             if j.cpus is not None and j.job_id not in moved
             and cluster.gpu_node[j.gpu_ids[0]] == node
             and len(cluster.gpus_by_node(j.gpu_ids)) == 1),
            key=lambda j: (-(j.cpus or 0.0) / j.gpus, j.job_id),
        )  # fmt: skip
        for job in above_share:
            fair_cpus, fair_mem = cluster.proportional_share(job.gpu_ids)
            cpus = min(job.cpus or fair_cpus, fair_cpus)
            mem = min(job.mem_gb or fair_mem, fair_mem)
            host.add(job.gpu_ids, job.cpus, job.mem_gb, -1)
            host.add(job.gpu_ids, cpus, mem, 1)
            lowered[job.job_id] = Reallocate(
                job.job_id, cpus, mem, "down to its GPU-proportional share for a new job"
            )
            if not _over(host, cluster, node):
                break
    # where lowering was not enough (a job joining a GPU whose resident holds its own
    # allocation brings its share too), the last starts there wait
    dropped: set[str] = set()
    for start in reversed(decision.starts):
        if any(_over(host, cluster, cluster.gpu_node[g]) for g in start.gpu_ids):
            if start.shares_with and start.cpus is None and start.mem_gb is None:
                host.add(start.gpu_ids, *cluster.proportional_share(start.gpu_ids), -1)
            else:
                host.add(start.gpu_ids, start.cpus, start.mem_gb, -1)
            dropped.add(start.job_id)
    starts: list[Start] = []
    for start in decision.starts:
        if start.job_id in dropped:
            continue
        nodes = cluster.gpus_by_node(start.gpu_ids)
        job = snapshot.job(start.job_id)
        if (
            len(nodes) != 1
            or start.shares_with
            or start.batch_size is not None
            or start.cpus is not None
            or start.mem_gb is not None
            or sized_by_search(job)  # ONES sizes by GPUs: a resize gives the share
        ):
            starts.append(start)
            continue
        (node,) = nodes
        best = best_case(snapshot, job, cluster.nodes[node])
        host.add(start.gpu_ids, None, None, -1)
        host.add(start.gpu_ids, best.cpus, best.mem_gb, 1)
        if _over(host, cluster, node):
            host.add(start.gpu_ids, best.cpus, best.mem_gb, -1)
            host.add(start.gpu_ids, None, None, 1)
            starts.append(start)
        else:
            starts.append(replace(start, cpus=best.cpus, mem_gb=best.mem_gb))
    resizes = decision.resizes
    if len(resizes) > 1:

        def lowered_before(changes: dict[str, Reallocate]) -> HostUse:
            applied = before_changes()
            for job_id, change in changes.items():
                job = snapshot.job(job_id)
                applied.add(job.gpu_ids, job.cpus, job.mem_gb, -1)
                applied.add(job.gpu_ids, change.cpus, change.mem_gb, 1)
            return applied

        ordered, fits = _fitting_order(snapshot, lowered_before(lowered), resizes)
        if not fits:
            # one job's resize waits for another's GPUs while that one waits for the
            # first's CPUs: the resized jobs drop to their share (which their resize
            # gives them anyway) before any resize
            for resize in resizes:
                job = snapshot.job(resize.job_id)
                if job.cpus is None and job.mem_gb is None:
                    continue
                fair_cpus, fair_mem = cluster.proportional_share(job.gpu_ids)
                lowered[job.job_id] = Reallocate(
                    job.job_id,
                    min(job.cpus or fair_cpus, fair_cpus),
                    min(job.mem_gb or fair_mem, fair_mem),
                    "down to its GPU-proportional share before its resize",
                )
            ordered, _ = _fitting_order(snapshot, lowered_before(lowered), resizes)
        resizes = ordered
    reasons = dict(decision.reasons)
    for job_id in dropped:
        reasons[job_id] = "waits for CPUs or memory on the node chosen for it"
    return replace(
        decision,
        starts=tuple(starts),
        reasons=reasons,
        resizes=resizes,
        reallocations=decision.reallocations + tuple(lowered[k] for k in sorted(lowered)),
    )


def _share_holders(snapshot: Snapshot, decision: Decision) -> Callable[[int], int]:
    """How many jobs hold each GPU's proportional share (its residents without an
    allocation of their own), counted for the GPUs ``decision`` changes."""
    load = snapshot.gpu_load
    if snapshot.own_allocations is False:
        return load.__getitem__
    changed = {g for s in decision.starts for g in s.gpu_ids}
    changed.update(g for r in decision.resizes for g in r.gpu_ids)
    changed.update(g for p in decision.preemptions for g in snapshot.job(p.job_id).gpu_ids)
    counted = dict.fromkeys(changed, 0)
    for job in snapshot.running:
        if job.cpus is None and job.mem_gb is None:
            for g in job.gpu_ids:
                if g in counted:
                    counted[g] += 1

    def holders(gpu: int) -> int:
        found = counted.get(gpu)
        return load[gpu] if found is None else found

    return holders


def _fitting_order(
    snapshot: Snapshot, host: HostUse, resizes: tuple[Resize, ...]
) -> tuple[tuple[Resize, ...], bool]:
    """``resizes`` in an order in which each fits the nodes' CPUs and memory when it is
    applied (those that move a job off a node first, making room for those that grow
    onto it), none before the jobs on its new GPUs have moved off them, and whether
    every one fits so (those that fit in no order keep their place at the end)."""
    cluster = snapshot.cluster
    ordered: list[Resize] = []
    left = list(resizes)
    while left:
        for resize in left:
            was = snapshot.job(resize.job_id)
            # its new GPUs must be free of the jobs still to move off them
            if any(
                other is not resize
                and not set(snapshot.job(other.job_id).gpu_ids).isdisjoint(resize.gpu_ids)
                for other in left
            ):
                continue
            host.add(was.gpu_ids, was.cpus, was.mem_gb, -1)
            host.add(resize.gpu_ids, None, None, 1)
            nodes = {cluster.gpu_node[g] for g in (*was.gpu_ids, *resize.gpu_ids)}
            if not any(_over(host, cluster, n) for n in nodes):
                ordered.append(resize)
                left.remove(resize)
                break
            host.add(resize.gpu_ids, None, None, -1)
            host.add(was.gpu_ids, was.cpus, was.mem_gb, 1)
        else:
            return (*ordered, *left), False
    return tuple(ordered), True


def _over(host: HostUse, cluster: Cluster, node: int) -> bool:
    """Whether ``node`` holds more CPUs or memory than it has."""
    limits = cluster.nodes[node]
    return (
        host.cpus(node) > limits.cpus + HOST_SLACK
        or host.mem(node) > limits.host_mem_gb + HOST_SLACK
    )


def _fewest_nodes(pool: dict[int, list[int]], nodes: list[int], size: int) -> list[int] | None:
    """``size`` GPUs taken out of ``pool`` on ``nodes``: all on the fullest node that
    fits them, else from the nodes with most room first; None (and nothing taken)
    where they hold fewer."""
    if sum(len(pool[n]) for n in nodes) < size:
        return None
    fits = [n for n in nodes if len(pool[n]) >= size]
    if fits:
        node = min(fits, key=lambda n: (len(pool[n]), n))
        taken, pool[node] = pool[node][:size], pool[node][size:]
        return taken
    taken = []
    for node in sorted(nodes, key=lambda n: (-len(pool[n]), n)):
        need = size - len(taken)
        taken += pool[node][:need]
        pool[node] = pool[node][need:]
        if len(taken) == size:
            break
    return taken


def sized_by_search(job: JobView) -> bool:
    """Whether rule 5 sizes this job: it declares elastic bounds and no priority."""
    return job.elastic is not None and job.priority == 0
