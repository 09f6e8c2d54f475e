"""The placement index: FreeGpus against a plain reading of its rules, and the CPU/memory
(FreeCapacity) and contiguity (ContiguousGpus) extensions keeping its counts."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.libs.core.cluster import Cluster, Node
from gpusched.libs.core.placement import FREE, TAKEN, ContiguousGpus, FreeCapacity, FreeGpus
from gpusched.libs.core.snapshot import Snapshot
from tests.builders import TablePerf


def _cluster(sizes: list[int]) -> Cluster:
    return Cluster(tuple(Node(f"n{i}", gpus) for i, gpus in enumerate(sizes)))


def _snapshot(cluster: Cluster, load: list[int]) -> Snapshot:
    node_free = tuple(
        sum(1 for g in cluster.node_gpus(i) if not load[g]) for i in range(len(cluster.nodes))
    )
    return Snapshot(
        now=0.0,
        cluster=cluster,
        pending=(),
        running=(),
        gpu_load=tuple(load),
        gpu_mem_used=(0.0,) * cluster.total_gpus,
        node_free=node_free,
        estimates=TablePerf(),
    )


def _idle(cluster: Cluster, load: list[int], node: int) -> list[int]:
    return [g for g in cluster.node_gpus(node) if load[g] == 0]


def _reference_take(cluster: Cluster, load: list[int], gpus: int) -> list[int] | None:
    """Best fit: the node with the fewest idle GPUs that holds the job (lowest index);
    else the nodes with the most idle GPUs first (lowest index), the lowest idle GPUs of
    each; the GPUs taken are marked in ``load``."""
    free = [len(_idle(cluster, load, n)) for n in range(len(cluster.nodes))]
    if gpus > sum(free):
        return None
    fits = [(f, n) for n, f in enumerate(free) if f >= gpus]
    if fits:
        plan = [(min(fits)[1], gpus)]
    else:
        plan, need = [], gpus
        for n in sorted(range(len(free)), key=lambda n: (-free[n], n)):
            if need == 0 or not free[n]:
                break
            plan.append((n, min(need, free[n])))
            need -= plan[-1][1]
    taken: list[int] = []
    for node, count in plan:
        for g in _idle(cluster, load, node)[:count]:
            load[g] = 1
            taken.append(g)
    return taken


sizes_st = st.lists(st.integers(0, 8), min_size=1, max_size=8).filter(any)


@settings(max_examples=150, deadline=None)
@given(sizes_st, st.data())
def test_free_gpus_takes_and_gives_back_as_the_rules_say(sizes: list[int], data) -> None:
    cluster = _cluster(sizes)
    load = [data.draw(st.integers(0, 2)) for _ in range(cluster.total_gpus)]
    free = FreeGpus(_snapshot(cluster, load))
    mine = [1 if x else 0 for x in load]
    held: list[list[int]] = []
    for _ in range(data.draw(st.integers(1, 12))):
        if held and data.draw(st.booleans()):
            gone = held.pop(data.draw(st.integers(0, len(held) - 1)))
            free.give_back(gone, cluster.gpu_node)
            for g in gone:
                mine[g] = 0
        else:
            gpus = data.draw(st.integers(1, 10))
            want = _reference_take(cluster, mine, gpus)
            assert free.take(gpus) == want
            if want is not None:
                held.append(want)
        idle = [len(_idle(cluster, mine, n)) for n in range(len(cluster.nodes))]
        assert free.free_per_node() == idle
        assert free.total == sum(idle)
        assert free.largest_block() == max(idle)


def test_nodes_holding_best_fit_or_by_index_and_spread_over_the_fewest() -> None:
    cluster = _cluster([8, 8, 8, 8])
    load = [0] * 32
    for g in (*range(0, 5), *range(8, 10), *range(24, 30)):  # idle: 3, 6, 8, 2
        load[g] = 1
    free = FreeGpus(_snapshot(cluster, load))
    assert list(free.nodes_holding(2)) == [3, 0, 1, 2]
    assert list(free.nodes_holding(3, best_fit=False)) == [0, 1, 2]
    assert list(free.nodes_holding(7)) == [2]
    assert free.spread(15) == {2: 8, 1: 6, 0: 1}
    assert free.spread(20) is None
    assert free.take_on({1: 2, 0: 1}) == (5, 10, 11)
    assert free.free_per_node() == [2, 4, 8, 2]
    assert list(free.nodes_holding(2)) == [0, 3, 1, 2]


def test_free_capacity_charges_a_job_by_its_gpus_on_each_node() -> None:
    cluster = _cluster([4, 4])
    room = FreeCapacity(_snapshot(cluster, [0] * 8), [24.0, 24.0], [100.0, 100.0])
    room.charge({0: 1, 1: 3}, 4, 8.0, 40.0)
    assert room.cpus == [22.0, 18.0]
    assert room.mem == [90.0, 70.0]
    room.charge({0: 1, 1: 3}, 4, 8.0, 40.0, -1.0)
    assert room.cpus == [24.0, 24.0] and room.mem == [100.0, 100.0]
    assert room.take(4) == [0, 1, 2, 3]


def _check_counts(line: ContiguousGpus, cluster: Cluster) -> None:
    idle = line.owner == FREE
    per_node = [int(idle[list(cluster.node_gpus(n))].sum()) for n in range(len(cluster.nodes))]
    assert line.free_per_node() == per_node
    assert line.total == int(idle.sum())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=6), st.data())
def test_contiguous_gpus_lays_blocks_and_keeps_the_counts(sizes: list[int], data) -> None:
    cluster = _cluster(sizes)
    total = cluster.total_gpus
    owner = np.array(
        [data.draw(st.sampled_from([FREE, FREE, 7])) for _ in range(total)], dtype=np.int64
    )
    line = ContiguousGpus(cluster, owner)
    _check_counts(line, cluster)
    for job in range(data.draw(st.integers(1, 10))):
        if data.draw(st.booleans()):
            before = owner.copy()
            at = line.take_tightest(job)
            if at is None:
                assert (before != FREE).all()
                continue
            # where the block search puts a job that holds no GPU
            assert at == ContiguousGpus(cluster, before).best_block(1)
            assert owner[at] == job
        else:
            n = data.draw(st.integers(1, 4))
            block = line.best_block(n)
            if block is None:
                continue
            assert line.is_free(block, n)
            line.take_block(block, n, job)
            assert (owner[block : block + n] == job).all()
        _check_counts(line, cluster)
    # the plain index questions and takes work on it too
    gpus = line.take(1)
    if gpus is not None:
        assert owner[gpus[0]] == TAKEN
        line.give_back(gpus, cluster.gpu_node)
        assert owner[gpus[0]] == FREE
    _check_counts(line, cluster)


def test_best_block_prefers_overlap_then_fewest_nodes_then_tightest_run() -> None:
    cluster = _cluster([4, 4, 4])
    owner = np.full(12, FREE, dtype=np.int64)
    owner[[0, 9]] = 5  # free runs: 1-8 (8 GPUs), 10-11 (2 GPUs)
    line = ContiguousGpus(cluster, owner)
    assert line.best_block(2) == 10  # the tightest run that holds it
    assert line.best_block(3) == 1  # 1-3 spans one node
    own = np.cumsum(np.isin(np.arange(-1, 12), [5, 6]))  # prefix sum of GPUs 5 and 6
    assert line.best_block(2, own) == 5
    assert line.best_block(9) is None
