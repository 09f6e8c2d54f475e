"""Jobs with data, tensor and pipeline parallelism: the communication model, the mapper,
the FreeGpus adapter, the ground truth, traces, the simulator and admission."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.core.cluster import Cluster, Node
from libs.core.parallelism import (
    ACTIVATION_FRACTION,
    LAYERS,
    Degrees,
    Traffic,
    consolidated,
    crossing_units,
    inter_server_bytes,
    iteration_time_at,
    map_job,
    traffic,
)
from libs.core.placement import FreeGpus
from libs.core.profiles.builtin import load_builtin
from libs.core.snapshot import Snapshot
from tests.builders import TablePerf

PROFILES, NETWORK = load_builtin()

degrees_st = st.builds(
    Degrees, st.integers(1, 4), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3])
)
free_st = st.lists(st.integers(0, 8), min_size=1, max_size=8)
node_sizes_st = st.lists(st.integers(1, 8), min_size=1, max_size=6)


def _cluster(sizes: list[int]) -> Cluster:
    return Cluster(tuple(Node(f"n{i}", gpus) for i, gpus in enumerate(sizes)))


def _free(cluster: Cluster, busy: list[int]) -> FreeGpus:
    """FreeGpus of ``cluster`` with the GPUs ``busy`` held by some job."""
    load = [0] * cluster.total_gpus
    for gpu in busy:
        load[gpu] = 1
    node_free = tuple(
        sum(1 for g in cluster.node_gpus(i) if not load[g]) for i in range(len(cluster.nodes))
    )
    snap = Snapshot(
        now=0.0,
        cluster=cluster,
        pending=(),
        running=(),
        gpu_load=tuple(load),
        gpu_mem_used=(0.0,) * cluster.total_gpus,
        node_free=node_free,
        estimates=TablePerf(),
    )
    return FreeGpus(snap)


def test_degrees_refuse_a_degree_below_one_naming_it() -> None:
    with pytest.raises(ValueError, match=r"^pipeline:"):
        Degrees(2, 2, 0)
    with pytest.raises(ValueError, match="tensor_parallel"):
        Degrees.of(6, tensor=4)
    assert Degrees.of(8, tensor=2, pipeline=2) == Degrees(2, 2, 2)
    assert Degrees(2, 2, 2).gpus == 8


def test_ranks_nest_tensor_inside_stage_inside_replica() -> None:
    d = Degrees(2, 2, 2)
    assert d.rank(replica=1, stage=0, tensor_index=1) == 5
    assert d.tensor_groups()[1] == range(2, 4)
    assert d.data_groups()[0] == range(0, 8, 4)
    assert d.pipeline_edges() == [[(0, 2), (1, 3), (4, 6), (5, 7)]]


@settings(max_examples=400, deadline=None)
@given(degrees=degrees_st, free=free_st, model=st.sampled_from(sorted(PROFILES)))
def test_the_mapper_never_moves_more_inter_server_bytes_than_consolidated_placement(
    degrees: Degrees, free: list[int], model: str
) -> None:
    profile = PROFILES[model]
    flows = traffic(profile, profile.default_batch_size * degrees.data, degrees)
    mapped = map_job(degrees, free, flows)
    plain = consolidated(degrees.gpus, free)
    if sum(free) < degrees.gpus:
        assert mapped is None and plain is None
        return
    assert mapped is not None and plain is not None
    assert len(mapped) == degrees.gpus
    for node in set(mapped):
        assert mapped.count(node) <= free[node]
    batch = profile.default_batch_size * degrees.data
    assert inter_server_bytes(degrees, profile, batch, mapped) <= inter_server_bytes(
        degrees, profile, batch, plain
    )
    assert len(set(mapped)) == len(set(plain))  # the fewest servers, like take()


@settings(max_examples=400, deadline=None)
@given(degrees=degrees_st, free=free_st)
def test_without_traffic_the_mapper_crosses_tensor_then_pipeline_then_data_no_more(
    degrees: Degrees, free: list[int]
) -> None:
    mapped = map_job(degrees, free)
    plain = consolidated(degrees.gpus, free)
    if plain is None:
        assert mapped is None
        return
    assert mapped is not None
    assert crossing_units(degrees, mapped) <= crossing_units(degrees, plain)


@settings(max_examples=300, deadline=None)
@given(degrees=degrees_st, nodes=node_sizes_st, data=st.data())
def test_take_parallel_gives_distinct_free_gpus_in_rank_order_where_the_mapper_says(
    degrees: Degrees, nodes: list[int], data: st.DataObject
) -> None:
    cluster = _cluster(nodes)
    busy = data.draw(st.lists(st.integers(0, cluster.total_gpus - 1), max_size=12))
    free = _free(cluster, busy)
    mapper = map_job if degrees.model_parallel > 1 else lambda d, f: consolidated(d.gpus, f)
    wanted = mapper(degrees, free.free_per_node())
    taken = free.take_parallel(degrees)
    if wanted is None:
        assert taken is None
        return
    assert taken is not None and len(set(taken)) == degrees.gpus
    assert not set(taken) & set(busy)
    assert tuple(cluster.gpu_node[g] for g in taken) == wanted
    assert free.total == cluster.total_gpus - len(set(busy)) - degrees.gpus


@settings(max_examples=300, deadline=None)
@given(gpus=st.integers(1, 24), nodes=node_sizes_st, data=st.data())
def test_plain_data_parallel_jobs_are_placed_exactly_as_take_places_them(
    gpus: int, nodes: list[int], data: st.DataObject
) -> None:
    cluster = _cluster(nodes)
    busy = data.draw(st.lists(st.integers(0, cluster.total_gpus - 1), max_size=12))
    expected = _free(cluster, busy).take(gpus)
    assert _free(cluster, busy).take_parallel(Degrees(gpus)) == expected
    # and consolidated() names the nodes take() uses, rank by rank
    free = _free(cluster, busy).free_per_node()
    if expected is None:
        assert consolidated(gpus, free) is None
    else:
        assert consolidated(gpus, free) == tuple(cluster.gpu_node[g] for g in expected)


def test_a_2x2x1_job_on_two_2_gpu_nodes_keeps_tensor_groups_inside_servers() -> None:
    degrees = Degrees(2, 2, 1)
    placement = map_job(degrees, [2, 2])
    assert placement == (0, 0, 1, 1)
    profile = PROFILES["gpt2"]
    batch = 16
    # tensor groups (0,1) and (2,3) stay inside; only the data all-reduce crosses: two
    # groups of two replicas, each a ring of 2 edges crossing, ring factor 2*(2-1)/2 = 1,
    # each carrying a tensor slice's gradients, comm_mb / t
    assert crossing_units(degrees, placement) == (0.0, 0.0, 4.0)
    assert inter_server_bytes(degrees, profile, batch, placement) == pytest.approx(
        4 * profile.comm_mb / 2 * 1e6
    )
    # by hand from the stated constants: compute at 8 samples per replica split over 2
    # GPUs; 4 * 24 all-reduces x m = 4 micro-batches of the layer output over NVLink;
    # the gradient slice all-reduced across the network
    per_replica = batch / 2
    compute = (profile.t0_s + profile.per_sample_s * per_replica) / 2
    act = ACTIVATION_FRACTION * profile.mem_per_sample_mb / LAYERS
    tensor = 4 * LAYERS * act * per_replica * 1.0 / 100_000.0
    data = 1.0 * (profile.comm_mb / 2) / 12_500.0 + 2 * 50e-6
    expected = compute + tensor + data
    assert iteration_time_at(profile, NETWORK, batch, degrees, placement) == pytest.approx(expected)
    # the other way round (each tensor group split across the servers) is slower
    assert iteration_time_at(profile, NETWORK, batch, degrees, (0, 1, 0, 1)) > expected


def test_a_plain_data_parallel_job_takes_the_ground_truths_analytic_time() -> None:
    from libs.core.groundtruth import ProfilePerformanceModel

    truth = ProfilePerformanceModel.builtin()
    for model in ("resnet50", "bert", "ncf"):
        profile = PROFILES[model]
        for nodes in ((0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 2, 3)):
            assert iteration_time_at(profile, NETWORK, 64, Degrees(4), nodes) == pytest.approx(
                truth.iteration_time(model, 64, 4, len(set(nodes))), rel=1e-12
            )


def test_traffic_is_heaviest_for_tensor_groups() -> None:
    flows = traffic(PROFILES["gpt2"], 16, Degrees(2, 2, 2))
    assert isinstance(flows, Traffic)
    assert flows.tensor_mb > flows.data_mb > 0
    assert flows.tensor_mb > flows.pipeline_mb > 0
