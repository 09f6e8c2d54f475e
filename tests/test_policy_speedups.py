"""The speed mechanisms of the policies decide exactly as the plain algorithms do.

- SRTF and Tiresias walk a queue the driver keeps in rank order and stop once the GPUs
  are spent; a reference that ranks every job with a full sort gives the same decision.
- SJF-BSBF pairs a job only with the groups of residents whose lower bound can still
  win; expanding every group first gives the same decision.
- SJF-BSBF remembers, across decisions, the queued jobs that found no partner; a fresh
  policy at every decision gives the same simulation.
- Reasons written on demand read as those written up front.
- Later mechanisms (SJF-BSBF's short roads, trying remembered jobs against new slots
  only, shared shape terms; Tiresias' running ranks kept across decisions): see the
  section at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.libs.core.cluster import Cluster, Node
from gpusched.libs.core.decision import Decision, Preempt, Start
from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.placement import FreeGpus, place_exclusive, unschedulable_reason
from gpusched.libs.core.shape import JobShape
from gpusched.libs.core.snapshot import JobView, Snapshot
from gpusched.services.scheduler.policies import make_policy, sjf_bsbf
from gpusched.services.scheduler.policies.base import (
    Capabilities,
    LazyReasons,
    Policy,
    QueueSort,
    busy_reason,
    no_room_reason,
)
from gpusched.services.scheduler.policies.preemptive import RunningRanks, Srtf, Tiresias
from gpusched.services.scheduler.policies.sharing import (
    Pairing,
    ShapeTerms,
    bound_coefficients,
    pair,
    shape_terms,
    t_concurrent,
)
from gpusched.services.scheduler.policies.sjf_bsbf import SjfBsbf
from gpusched.services.scheduler.policies.slots import build_groups
from gpusched.services.scheduler.policies.synergy import SynergyTune
from gpusched.services.scheduler.simulation.simulator import SimConfig, Simulator, simulate
from tests.builders import TablePerf, cluster, job, pending, running, snapshot

PERF = TablePerf(
    iter_s={"a": 1.0, "b": 0.5, "c": 2.0},
    mem_mb={"a": 3000.0, "b": 6000.0, "c": 9000.0},
    slowdown={("a", "b"): 1.2, ("b", "a"): 1.6, ("c", "c"): 2.5, ("a", "a"): 1.05},
    spread_penalty=1.3,
    accum_exponent=0.5,
)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- reference ranking


def reference_decide_by_rank(
    snapshot: Snapshot, rank: Callable[[JobView], tuple], describe: Callable[[JobView], str]
) -> Decision:
    """The plain algorithm: rank every job with a full sort, walk all of them."""
    reasons: dict[str, str] = {}
    candidates = list(snapshot.running)
    for j in snapshot.pending:
        bad = unschedulable_reason(j, snapshot)
        if bad:
            reasons[j.job_id] = bad
        else:
            candidates.append(j)
    candidates.sort(key=rank)
    budget = snapshot.cluster.total_gpus
    winners: list[JobView] = []
    losers: list[JobView] = []
    for j in candidates:
        if j.gpus <= budget:
            budget -= j.gpus
            winners.append(j)
        elif j.running:
            losers.append(j)
        else:
            reasons[j.job_id] = (
                f"{describe(j)}; higher-ranked jobs hold the GPUs it needs ({j.gpus})"
            )
    free = FreeGpus(snapshot)
    starts: list[Start] = []
    preemptions: list[Preempt] = []
    for j in winners:
        if j.running:
            continue
        start = place_exclusive(j, free, snapshot)
        while start is None and losers:
            victim = losers.pop()
            preemptions.append(Preempt(victim.job_id, f"preempted for {j.job_id}"))
            free.give_back(victim.gpu_ids, snapshot.cluster.gpu_node)
            start = place_exclusive(j, free, snapshot)
        if start is None:
            reasons[j.job_id] = f"{describe(j)}; {no_room_reason(j, free)}"
        else:
            starts.append(start)
    return Decision(
        tuple(starts), tuple(preemptions), reasons=reasons, default_reason=busy_reason(snapshot)
    )


def reference(policy: Srtf | Tiresias, snap: Snapshot) -> Decision:
    now = snap.now
    if isinstance(policy, Srtf):
        return reference_decide_by_rank(
            snap,
            lambda j: (j.oracle_remaining_at(now), j.submit_time, j.job_id),
            lambda j: f"{j.oracle_remaining_at(now):.0f} s of work left",
        )
    return reference_decide_by_rank(
        snap,
        # running jobs first within a queue
        lambda j: (policy.queue_of(j, now), 0 if j.running else 1, j.submit_time, j.job_id),
        lambda j: f"priority queue {policy.queue_of(j, now)}",
    )


@st.composite
def ranked_snapshots(draw: st.DrawFn) -> Snapshot:
    """A cluster partly held by running jobs, a queue of fresh and preempted jobs."""
    nodes = draw(st.integers(1, 3))
    cl = cluster(nodes, 4, gpu_mem_mb=20_000)
    total = cl.total_gpus
    now = draw(st.floats(0, 20_000))
    free = list(range(total))
    held: list[JobView] = []
    for i in range(draw(st.integers(0, 6))):
        size = draw(st.sampled_from([1, 1, 2, 4]))
        if size > len(free):
            break
        gpus = tuple(free[:size])
        del free[:size]
        view = running(
            f"r{i}",
            draw(st.floats(1, 50_000)),
            gpus,
            model=draw(st.sampled_from("abc")),
            attained=draw(st.floats(0, 50_000)),
            as_of=now - draw(st.floats(0, 5_000)),
        )
        held.append(replace(view, submit_time=draw(st.floats(0, 1_000))))
    queue = []
    for i in range(draw(st.integers(0, 10))):
        attained = draw(st.sampled_from([0.0, 100.0, 5_000.0, 40_000.0]))
        queue.append(
            pending(
                f"p{i}",
                draw(st.floats(1, 50_000)),
                gpus=draw(st.sampled_from([1, 1, 2, 3, 4, 8, 16])),
                submit=draw(st.floats(0, 1_000)),
                model=draw(st.sampled_from("abc")),
                batch=draw(st.sampled_from([32, 64, 256])),
                attained=attained,
                queued_since=now - draw(st.floats(0, 400_000)),
            )
        )
    return snapshot(cl, PERF, queue, held, now=now)


def in_order(snap: Snapshot, policy: Srtf | Tiresias) -> Snapshot:
    """The snapshot a driver that keeps the policy's queue orders would give."""
    sort = policy.queue_sort
    assert sort is not None
    extra = policy.capabilities.extra_sorts
    return replace(
        snap,
        pending=tuple(sorted(snap.pending, key=sort.key)),
        queue_order=sort.name,
        orders={e.name: tuple(sorted(snap.pending, key=e.key)) for e in extra},
    )


def same_decision(got: Decision, want: Decision, snap: Snapshot) -> None:
    assert got.starts == want.starts
    assert got.preemptions == want.preemptions
    for j in snap.pending:
        if j.job_id not in {s.job_id for s in got.starts}:
            assert got.why(j.job_id) == want.why(j.job_id), j.job_id


@pytest.mark.parametrize(
    "policy", [Srtf(), Tiresias(), Tiresias(thresholds_gpu_s=(50.0, 500.0, 5_000.0))]
)
@SETTINGS
@given(snap=ranked_snapshots())
def test_the_rank_walk_decides_as_a_full_sort_does(policy: Srtf | Tiresias, snap: Snapshot):
    want = reference(policy, snap)
    same_decision(policy.decide(snap), want, snap)  # queue in arrival order
    same_decision(policy.decide(in_order(snap, policy)), want, snap)


@dataclass
class NoQueueSort:
    """The policy without its queue sort: the simulator keeps the queue in arrival order."""

    inner: Policy

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def preemptive(self) -> bool:
        return self.inner.preemptive

    queue_sort = None
    capabilities = Capabilities()

    def decide(self, snap: Snapshot) -> Decision:
        return self.inner.decide(snap)


@dataclass
class FreshEachTime:
    """A new policy object at every decision: nothing remembered between decisions."""

    factory: Callable[[], Policy]

    @property
    def name(self) -> str:
        return self.factory().name

    @property
    def preemptive(self) -> bool:
        return self.factory().preemptive

    @property
    def queue_sort(self) -> QueueSort | None:
        return self.factory().queue_sort

    capabilities = Capabilities()

    def decide(self, snap: Snapshot) -> Decision:
        return self.factory().decide(snap)


job_rows = st.lists(
    st.tuples(
        st.floats(min_value=0, max_value=500, allow_nan=False),
        st.integers(min_value=1, max_value=300),
        st.sampled_from([1, 1, 1, 2, 4]),
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from([32, 64, 256]),
    ),
    min_size=1,
    max_size=30,
)


def trace(rows) -> list:
    return [
        job(f"j{i}", submit, iters, gpus=gpus, model=model, batch=batch)
        for i, (submit, iters, gpus, model, batch) in enumerate(rows)
    ]


def outcomes(policy: Policy, rows, nodes: int = 2, perf: TablePerf = PERF) -> list[tuple]:
    result = simulate(cluster(nodes, 4), trace(rows), policy, perf, config=SimConfig(30.0))
    return [(o.job_id, o.start_time, o.finish_time, o.preemptions, o.shared) for o in result.jobs]


@pytest.mark.parametrize("name", ["srtf", "tiresias"])
@SETTINGS
@given(rows=job_rows)
def test_a_queue_kept_in_rank_order_changes_no_outcome(name: str, rows):
    assert outcomes(make_policy(name), rows) == outcomes(NoQueueSort(make_policy(name)), rows)


@pytest.mark.parametrize("name", ["sjf-bsbf", "sjf-ffs"])
@SETTINGS
@given(rows=job_rows, nodes=st.integers(1, 2))
def test_remembering_jobs_without_a_partner_changes_no_outcome(name: str, rows, nodes: int):
    kept = outcomes(make_policy(name), rows, nodes)
    assert kept == outcomes(FreshEachTime(lambda: make_policy(name)), rows, nodes)


@st.composite
def shared_snapshots(draw: st.DrawFn) -> Snapshot:
    """Every GPU busy with one resident; a queue that can only share."""
    nodes = draw(st.integers(1, 3))
    cl = cluster(nodes, 4, gpu_mem_mb=20_000)
    held = []
    gpu = 0
    i = 0
    while gpu < cl.total_gpus:
        size = min(draw(st.sampled_from([1, 1, 2])), cl.total_gpus - gpu)
        held.append(
            running(
                f"r{i}",
                draw(st.floats(1, 5_000)),
                tuple(range(gpu, gpu + size)),
                model=draw(st.sampled_from("abc")),
                batch=draw(st.sampled_from([32, 64])),
            )
        )
        gpu += size
        i += 1
    queue = [
        pending(
            f"p{k}",
            draw(st.floats(1, 5_000)),
            gpus=draw(st.sampled_from([1, 1, 2, 3])),
            model=draw(st.sampled_from("abc")),
            batch=draw(st.sampled_from([32, 64, 256])),
        )
        for k in range(draw(st.integers(1, 8)))
    ]
    return snapshot(cl, PERF, queue, held)


@pytest.mark.parametrize("benefit_test", [True, False])
@SETTINGS
@given(snap=shared_snapshots())
def test_pruning_groups_by_their_bound_picks_what_pairing_every_group_picks(
    benefit_test: bool, snap: Snapshot
):
    pruned = SjfBsbf(benefit_test=benefit_test).decide(snap)
    warm = SjfBsbf(benefit_test=benefit_test)
    warm.decide(snap)  # pairings known: the tight bounds are used the second time
    again = warm.decide(snap)
    with zero_bounds():
        full = SjfBsbf(benefit_test=benefit_test).decide(snap)
    for got in (pruned, again):
        assert got.starts == full.starts
        assert got.wake_at == full.wake_at
        for j in snap.pending:
            assert got.why(j.job_id) == full.why(j.job_id)


@contextmanager
def zero_bounds() -> Iterator[None]:
    """Bounds of zero: every group is paired before any slot is taken."""
    saved = sjf_bsbf._BOUND_SCALE, sjf_bsbf._TIGHT_SCALE
    sjf_bsbf._BOUND_SCALE = sjf_bsbf._TIGHT_SCALE = 0.0
    try:
        yield
    finally:
        sjf_bsbf._BOUND_SCALE, sjf_bsbf._TIGHT_SCALE = saved


def test_lazy_reasons_read_like_a_dict():
    jobs = (pending("a", 1), pending("b", 2), pending("c", 3))
    asked: list[str] = []

    def reason_of(view: JobView) -> str | None:
        asked.append(view.job_id)
        return None if view.job_id == "c" else f"late {view.job_id}"

    reasons = LazyReasons({"a": "early a"}, jobs, reason_of)
    assert asked == []  # nothing is written until asked for
    assert reasons["a"] == "early a"
    assert reasons.get("b") == "late b"
    assert reasons.get("c", "default") == "default"
    assert reasons.get("zzz") is None
    assert "b" in reasons and "c" not in reasons
    with pytest.raises(KeyError):
        reasons["c"]
    assert dict(reasons) == {"a": "early a", "b": "late b"}
    assert len(reasons) == 2
    decision = Decision(reasons=reasons, default_reason="busy")
    assert decision.why("c") == "busy" and decision.why("b") == "late b"


# ---------------------------------------------------------------- later mechanisms
#
# - SJF-BSBF takes shorter roads than the heap search: a one-GPU job's choice is its
#   single best slot, and a job needing more GPUs than there are open slots only has its
#   wake-up worked out. A queued job that found no partner is tried again only against
#   the slots born since (unless one of the old slots may have entered a benefit window).
# - SJF-BSBF works out a job shape's sub-batch terms once and shares them across groups.
# - Tiresias keeps its running jobs ranked across decisions.


def heap_search_only(policy: Policy) -> SjfBsbf:
    """``policy`` (an SJF-BSBF) without its short roads: the reference to compare with."""
    assert isinstance(policy, SjfBsbf)
    return replace(policy, fast_paths=False)


@dataclass(frozen=True)
class AccumPerf(TablePerf):
    """Slowdowns that fall as a job splits its batch into more sub-batches, so one job
    shape has several sub-batches worth trying beside one resident."""

    def colocation_slowdown(self, shape: JobShape, partner: JobShape) -> float:
        base = self.slowdown.get((shape.model, partner.model), self.default_slowdown)
        own = {1: 1.0, 2: 0.7, 4: 0.55, 8: 0.5, 16: 0.5}[shape.accum_steps]
        other = {1: 1.0, 2: 0.95, 4: 0.9, 8: 0.9, 16: 0.9}[partner.accum_steps]
        return max(1.0, base * own * (2 - other))


PERF_ACCUM = AccumPerf(
    iter_s=PERF.iter_s,
    mem_mb=PERF.mem_mb,
    slowdown={("a", "b"): 1.5, ("b", "a"): 1.9, ("c", "c"): 2.5, ("a", "a"): 1.3},
    spread_penalty=1.3,
    accum_exponent=0.1,
)
TIED = st.sampled_from([50.0, 100.0, 150.0, 200.0, 400.0, 800.0, 1600.0])
RATES = st.sampled_from([0.25, 0.5, 1.0])


@st.composite
def tied_snapshots(draw: st.DrawFn) -> Snapshot:
    """Every GPU busy with one resident; few distinct remaining times, so t_con ties."""
    cl = cluster(draw(st.integers(1, 2)), 4, gpu_mem_mb=20_000)
    held = [
        replace(
            running(
                f"r{g}",
                draw(TIED),
                (g,),
                model=draw(st.sampled_from("abc")),
                batch=draw(st.sampled_from([32, 64])),
            ),
            progress_rate=draw(RATES),
        )
        for g in range(cl.total_gpus)
    ]
    queue = [
        pending(
            f"p{k}",
            draw(TIED),
            gpus=draw(st.sampled_from([1, 1, 1, 2])),
            model=draw(st.sampled_from("abc")),
            batch=draw(st.sampled_from([32, 64, 256])),
        )
        for k in range(draw(st.integers(1, 6)))
    ]
    return snapshot(cl, draw(st.sampled_from([PERF, PERF_ACCUM])), queue, held)


@pytest.mark.parametrize("benefit_test", [True, False])
@SETTINGS
@given(snap=st.one_of(shared_snapshots(), tied_snapshots()))
def test_the_short_roads_pick_what_the_heap_search_picks(benefit_test: bool, snap: Snapshot):
    want = SjfBsbf(benefit_test=benefit_test, fast_paths=False).decide(snap)
    fresh = SjfBsbf(benefit_test=benefit_test)
    got = fresh.decide(snap)
    again = fresh.decide(snap)  # pairings and no-partner memory known the second time
    for decision in (got, again):
        assert decision.starts == want.starts
        assert decision.wake_at == want.wake_at
        for j in snap.pending:
            assert decision.why(j.job_id) == want.why(j.job_id)


# residents that progress at different rates (accumulation, spread over nodes), so that
# a resident other than the least loaded can be the first to enter a benefit window
job_rows_varied = st.lists(
    st.tuples(
        st.floats(min_value=0, max_value=500, allow_nan=False),
        st.integers(min_value=1, max_value=300),
        st.sampled_from([1, 1, 1, 1, 2, 3, 4]),
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from([8, 32, 64, 256]),
    ),
    min_size=1,
    max_size=40,
)


@pytest.mark.parametrize("name", ["sjf-bsbf", "sjf-ffs"])
@SETTINGS
@given(rows=job_rows_varied, nodes=st.integers(1, 3), accum=st.booleans())
def test_searching_remembered_jobs_against_new_slots_only_changes_no_outcome(
    name: str, rows, nodes: int, accum: bool
):
    perf = PERF_ACCUM if accum else PERF
    got = outcomes(make_policy(name), rows, nodes, perf)
    assert got == outcomes(heap_search_only(make_policy(name)), rows, nodes, perf)
    assert got == outcomes(
        FreshEachTime(lambda: heap_search_only(make_policy(name))), rows, nodes, perf
    )


@SETTINGS
@given(snap=shared_snapshots())
def test_shape_terms_shared_across_groups_pair_as_plain_pairing_does(snap: Snapshot):
    groups = build_groups(snap)
    terms: dict[tuple, ShapeTerms] = {}
    made: dict = {}
    for j in snap.pending:
        shape = (j.model, j.batch_size, j.gpus)
        if shape not in terms:
            terms[shape] = shape_terms(j, snap)
        for group in groups:
            want = pair(j, group, snap)
            assert pair(j, group, snap, terms[shape], made) == want


@SETTINGS
@given(rows=job_rows_varied, nodes=st.integers(1, 2))
def test_running_jobs_ranked_across_decisions_change_no_outcome(rows, nodes: int):
    # thresholds low enough that running jobs change queue while they run, and (second)
    # promotions quick enough that promoted runs, placed by their own service, are common
    for knobs in ({"min_wait_s": 30.0}, {"min_wait_s": 5.0, "promote_knob": 1.0}):

        def make() -> Tiresias:
            return Tiresias(thresholds_gpu_s=(20.0, 90.0, 400.0), **knobs)  # noqa: B023

        got = outcomes(make(), rows, nodes)
        assert got == outcomes(replace(make(), keep_running_ranks=False), rows, nodes), knobs


@st.composite
def slot_sequences(draw: st.DrawFn) -> tuple[Snapshot, Snapshot]:
    """Two decisions' snapshots over the same residents: in the second, time has passed
    (residents progress at different rates) and one GPU has become a new slot."""
    cl = cluster(draw(st.integers(1, 2)), 4, gpu_mem_mb=20_000)
    last = cl.total_gpus - 1

    def resident(job_id: str, gpu: int) -> JobView:
        view = running(
            job_id,
            draw(TIED),
            (gpu,),
            model=draw(st.sampled_from("abc")),
            batch=draw(st.sampled_from([32, 64])),
        )
        return replace(view, progress_rate=draw(RATES))

    held = [resident(f"r{g}", g) for g in range(last)]
    first, second = resident("x", last), resident("y", last)
    queue = [
        pending(
            f"p{k}",
            draw(TIED),
            model=draw(st.sampled_from("abc")),
            batch=draw(st.sampled_from([32, 64, 256])),
        )
        for k in range(draw(st.integers(1, 5)))
    ]
    later = draw(st.sampled_from([0.0, 10.0, 40.0, 100.0, 300.0, 700.0]))
    perf = draw(st.sampled_from([PERF, PERF_ACCUM]))
    before = snapshot(cl, perf, queue, [*held, first, second])
    return before, replace(before, now=later, running=(*held, replace(first)))


@pytest.mark.parametrize("benefit_test", [True, False])
@settings(SETTINGS, max_examples=300)
@given(pair_of=slot_sequences())
def test_a_remembered_job_tried_against_new_slots_decides_as_a_fresh_policy(
    benefit_test: bool, pair_of: tuple[Snapshot, Snapshot]
):
    before, sketch = pair_of
    warm = SjfBsbf(benefit_test=benefit_test)
    first = warm.decide(before)  # remembers the jobs that found no partner
    # the second snapshot follows the first decision: its starts share their GPUs
    started = {s.job_id: s for s in first.starts}
    sharing = [
        running(j.job_id, j.est_remaining_s, started[j.job_id].gpu_ids, j.model, j.batch_size)
        for j in before.pending
        if j.job_id in started
    ]
    after = snapshot(
        before.cluster,
        before.estimates,  # type: ignore[arg-type]
        [j for j in before.pending if j.job_id not in started],
        [*sketch.running, *sharing],
        now=sketch.now,
    )
    got = warm.decide(after)
    want = SjfBsbf(benefit_test=benefit_test).decide(after)
    assert got.starts == want.starts
    assert got.wake_at == want.wake_at
    for j in after.pending:
        assert got.why(j.job_id) == want.why(j.job_id)


SLOW = st.floats(1, 4)


@SETTINGS
@given(
    shapes=st.lists(st.tuples(SLOW, SLOW, st.floats(1, 3)), min_size=1, max_size=5),
    e_a=st.floats(1e-9, 1e6),
    e_b=st.floats(0, 1e6),
)
def test_a_groups_coefficient_bound_lies_below_every_pairings_t_con(
    shapes: list[tuple[float, float, float]], e_a: float, e_b: float
):
    pairings = tuple(Pairing.make(k, *shape) for k, shape in enumerate(shapes, 1))
    a1, b1, a2 = bound_coefficients(pairings)
    bound = sjf_bsbf._TIGHT_SCALE * min(a1 * e_a + b1 * e_b, a2 * e_a + 0.5 * e_b)
    t_cons = [t_concurrent(e_a * p.stretch, e_b, p.x_a, p.x_b) for p in pairings]
    assert bound <= min(t_cons)


BUILTIN = load_performance_model(None)


@st.composite
def builtin_snapshots(draw: st.DrawFn) -> Snapshot:
    """Residents and a queue of built-in models, the queue's shapes of one model sharing
    per-GPU batches across GPU counts (so their slowdowns, which follow the sub-batch,
    are alike)."""
    models = BUILTIN.models()[:4]
    cl = cluster(2, 4, gpu_mem_mb=40_000)
    held = []
    gpu = 0
    while gpu < cl.total_gpus:
        size = min(draw(st.sampled_from([1, 1, 2])), cl.total_gpus - gpu)
        model = draw(st.sampled_from(models))
        held.append(
            running(
                f"r{gpu}",
                draw(st.floats(1, 5_000)),
                tuple(range(gpu, gpu + size)),
                model=model,
                batch=BUILTIN.default_batch_size(model) * size,
            )
        )
        gpu += size
    queue = []
    for k in range(draw(st.integers(1, 8))):
        model = draw(st.sampled_from(models))
        gpus = draw(st.sampled_from([1, 2, 4]))
        per_gpu = BUILTIN.default_batch_size(model) // draw(st.sampled_from([1, 2]))
        queue.append(
            pending(f"p{k}", draw(st.floats(1, 5_000)), gpus, model=model, batch=per_gpu * gpus)
        )
    return snapshot(cl, BUILTIN, queue, held)  # type: ignore[arg-type]


@SETTINGS
@given(snap=builtin_snapshots())
def test_slowdown_rows_shared_by_shapes_of_one_per_gpu_batch_pair_as_plain_pairing_does(
    snap: Snapshot,
):
    policy = SjfBsbf()
    policy.decide(snap)
    groups = {g.key: g for g in build_groups(snap)}
    jobs = {(j.model, j.batch_size, j.gpus): j for j in snap.pending}
    for (shape, key), pairings in policy._pairings.items():
        assert pairings == pair(jobs[shape], groups[key], snap)


OTHER_PERF = TablePerf(
    iter_s=PERF.iter_s,
    mem_mb={"a": 2000.0, "b": 9000.0, "c": 4000.0},
    slowdown={("a", "b"): 1.9, ("b", "a"): 1.05, ("c", "c"): 1.1, ("a", "a"): 1.7},
    default_slowdown=1.1,
    spread_penalty=1.0,
    accum_exponent=0.2,
)


@pytest.mark.parametrize("benefit_test", [True, False])
@SETTINGS
@given(snap=shared_snapshots())
def test_a_policy_kept_across_performance_models_decides_as_a_fresh_one(
    benefit_test: bool, snap: Snapshot
):
    kept = SjfBsbf(benefit_test=benefit_test)
    kept.decide(snap)  # pairings worked out under PERF
    other = snapshot(snap.cluster, OTHER_PERF, list(snap.pending), list(snap.running))
    got = kept.decide(other)
    want = SjfBsbf(benefit_test=benefit_test).decide(other)
    assert got.starts == want.starts
    assert got.wake_at == want.wake_at


@pytest.mark.parametrize("benefit_test", [True, False])
@SETTINGS
@given(snap=st.one_of(shared_snapshots(), tied_snapshots()), cap=st.sampled_from([1.1, 1.3, 2.0]))
def test_with_a_resident_slowdown_cap_the_short_roads_pick_what_the_heap_search_picks(
    benefit_test: bool, snap: Snapshot, cap: float
):
    def make() -> SjfBsbf:
        return SjfBsbf(benefit_test=benefit_test, max_resident_slowdown=cap)

    want = replace(make(), fast_paths=False).decide(snap)
    fresh = make()
    got = fresh.decide(snap)
    again = fresh.decide(snap)
    for decision in (got, again):
        assert decision.starts == want.starts
        assert decision.wake_at == want.wake_at
        for j in snap.pending:
            assert decision.why(j.job_id) == want.why(j.job_id)
    # no resident is slowed past the cap
    views = {v.job_id: v for v in (*snap.pending, *snap.running)}
    for start in got.starts:
        a = views[start.job_id]
        for partner in start.shares_with:
            b = views[partner]
            slowdown = snap.estimates.colocation_slowdown(
                JobShape(b.model, b.batch_size, b.gpus, b.accum_steps),
                JobShape(a.model, a.batch_size, a.gpus, start.accum_steps),
            )
            assert slowdown <= cap


def _greedy_writing_every_reason(snap: Snapshot, ordered: list[JobView]) -> Decision:
    """A backfilling greedy scan that tries every job and writes each reason at once."""
    free = FreeGpus(snap)
    starts: list[Start] = []
    reasons: dict[str, str] = {}
    for j in ordered:
        if free.total == 0:
            break
        bad = unschedulable_reason(j, snap)
        if bad:
            reasons[j.job_id] = bad
            continue
        start = place_exclusive(j, free, snap)
        if start is None:
            reasons[j.job_id] = no_room_reason(j, free)
        else:
            starts.append(start)
    return Decision(tuple(starts), reasons=reasons, default_reason=busy_reason(snap))


@SETTINGS
@given(snap=ranked_snapshots())
def test_a_greedy_scan_passing_over_jobs_too_wide_for_the_idle_gpus_reads_as_trying_each(
    snap: Snapshot,
):
    from gpusched.services.scheduler.policies.base import greedy_exclusive

    ordered = sorted(snap.pending, key=lambda j: (j.submit_time, j.job_id))
    same_decision(
        greedy_exclusive(snap, ordered, backfill=True), _greedy_writing_every_reason(snap, ordered),
        snap,
    )  # fmt: skip


def test_kept_ranks_handed_the_same_running_tuple_again_rank_as_anew():
    """The kept ranking skips its scan when a driver hands it the very tuple of running
    views it last saw; it must still re-rank the jobs that cross a threshold since, and
    forget the tuple when time goes back."""
    tiresias = Tiresias(thresholds_gpu_s=(100.0, 1_000.0))
    views = (
        running("r1", 500.0, (0,), attained=90.0, as_of=0.0),
        running("r2", 500.0, (1, 2), attained=40.0, as_of=0.0),
        running("r3", 500.0, (3,), attained=950.0, as_of=0.0),
    )

    def fresh(now: float) -> tuple[list, float]:
        ranks = RunningRanks(tiresias.thresholds_gpu_s, tiresias._service_as_of)
        wake = ranks.update(views, now)
        return list(ranks.ranked), wake

    kept = RunningRanks(tiresias.thresholds_gpu_s, tiresias._service_as_of)
    for now in (0.0, 5.0, 20.0, 31.0, 60.0, 10.0, 70.0):  # r1, r2 and r3 cross; 10: back
        wake = kept.update(views, now)
        assert (list(kept.ranked), wake) == fresh(now), now


class FreshTuneBeside(Simulator):
    """Decides with the kept policy and, on the same snapshot, with a fresh one; counts
    decisions where the kept one read the running jobs from its last decision."""

    reused = 0

    def _snapshot(self, now: float) -> Snapshot:
        snap = super()._snapshot(now)
        policy = self.policy
        assert isinstance(policy, SynergyTune)
        kept = policy._vectors.last_running is snap.running
        got = policy.decide(snap)
        want = replace(policy, _vectors=type(policy._vectors)()).decide(snap)
        assert (got.starts, got.preemptions, got.reallocations, got.wake_at) == (
            want.starts, want.preemptions, want.reallocations, want.wake_at
        )
        self.reused += kept
        return snap


@pytest.mark.parametrize("name", ["synergy-fifo", "synergy-las"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(
    st.floats(0, 400, allow_nan=False), st.integers(1, 300), st.sampled_from([1, 1, 2, 4, 8]),
    st.sampled_from(["resnet18", "resnet50", "lm", "transformer", "vgg16"]),
), min_size=2, max_size=14))
def test_tune_reading_the_same_running_tuple_again_decides_as_a_fresh_policy(name, rows):
    """TUNE keeps the running jobs' records and the CPUs and memory they leave free while
    the driver hands the same running tuple; a decision then equals a fresh policy's."""
    truth = load_performance_model(None)
    known = set(truth.models())
    trace = [
        JobSpec(f"j{i}", submit, model, gpus, truth.default_batch_size(model) * gpus, iters)
        for i, (submit, iters, gpus, model) in enumerate(rows)
        if model in known
    ]
    if not trace:
        return
    nodes = tuple(Node(f"s{i}", 8, cpus=24, host_mem_gb=500.0) for i in range(2))
    sim = FreshTuneBeside(Cluster(nodes), trace, make_policy(name), truth,
                          config=SimConfig(round_s=60.0))
    sim.run()
