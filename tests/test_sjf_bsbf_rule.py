"""The SJF-BSBF share rule against the formulas of the design (section 5)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.services.scheduler.policies import make_policy
from gpusched.services.scheduler.policies.sharing import BenefitWindow, t_concurrent, t_sequential
from gpusched.services.scheduler.policies.sjf_bsbf import SjfBsbf
from gpusched.services.scheduler.policies.slots import SlotGroup
from tests.builders import TablePerf, cluster, pending, running, snapshot

slowdowns = st.floats(min_value=1.0, max_value=6.0)
times = st.floats(min_value=0.01, max_value=1e6)


def test_the_formulas_give_the_worked_example():
    # A: 10 s, B: 40 s, both slowed 1.25x: B outlasts A, so the second branch applies
    assert t_sequential(10, 40) == 45
    assert t_concurrent(10, 40, 1.25, 1.25) == pytest.approx(40 / 2 + (1 - 1 / 2.5) * 1.25 * 10)
    # A outlasts B: first branch
    assert t_concurrent(100, 10, 1.5, 2.0) == pytest.approx(50 + (1 - 1 / 3) * 2.0 * 10)


@given(e_a=times, e_b=times, x_a=slowdowns, x_b=slowdowns)
def test_t_concurrent_is_the_mean_of_the_two_completion_times_of_a_shared_run(e_a, e_b, x_a, x_b):
    # simulate the pair directly: both slowed until the first finishes, then the other alone
    first_a = x_a * e_a <= x_b * e_b
    t_first = min(x_a * e_a, x_b * e_b)
    left = (e_b - t_first / x_b) if first_a else (e_a - t_first / x_a)
    mean = (t_first + t_first + left) / 2
    assert t_concurrent(e_a, e_b, x_a, x_b) == pytest.approx(mean, rel=1e-9, abs=1e-6)


@given(
    e_a=times,
    e_b=times,
    x_a=slowdowns,
    x_b=slowdowns,
    stretch=st.sampled_from([1.0, 1.1, 1.5, 2.0, 4.0]),
)
def test_the_benefit_window_agrees_with_the_direct_comparison(e_a, e_b, x_a, x_b, stretch):
    window = BenefitWindow.of(e_a, e_a * stretch, x_a, x_b)
    inside = window.low1 < e_b <= window.high1 or e_b > window.low2
    pays = t_concurrent(e_a * stretch, e_b, x_a, x_b) < t_sequential(e_a, e_b)
    margin = 1e-9 * (e_a + e_b) * stretch * x_a * x_b
    direct_gap = abs(t_concurrent(e_a * stretch, e_b, x_a, x_b) - t_sequential(e_a, e_b))
    if direct_gap > margin:  # away from the boundary both must agree
        assert inside == pays


@given(e_a=times, x_a=slowdowns, x_b=slowdowns, stretch=st.sampled_from([1.0, 1.5, 2.0, 4.0]))
def test_once_sharing_does_not_pay_it_never_starts_paying_as_the_resident_progresses(
    e_a, x_a, x_b, stretch
):
    # the resident's remaining time only shrinks while A waits, so a "not yet" could only
    # turn into a "yes" across a gap (low1 < high1 < low2); the formulas leave no such gap,
    # which is why SJF-BSBF's decisions rarely need a wake-up
    window = BenefitWindow.of(e_a, e_a * stretch, x_a, x_b)
    assert not (window.low1 < window.high1 < window.low2)


def test_the_shorter_resident_is_chosen_when_both_would_pay():
    perf = TablePerf()
    cl = cluster(1, 2)
    snap = snapshot(
        cl, perf, [pending("a", 5)], [running("long", 70, (0,)), running("short", 30, (1,))]
    )
    decision = make_policy("sjf-bsbf").decide(snap)
    (start,) = decision.starts
    assert start.gpu_ids == (1,) and start.shares_with == ("short",)


def test_accumulation_steps_are_raised_until_the_pair_fits_in_gpu_memory():
    # the resident holds 6000 MiB of a 10000 MiB GPU
    perf = TablePerf(mem_mb={"a": 1000.0, "b": 6000.0})
    cl = cluster(1, 1)
    snap = snapshot(cl, perf, [pending("a", 50, batch=512)], [running("r", 100, (0,), model="b")])
    (start,) = SjfBsbf().decide(snap).starts
    # memory of A at sub-batch 512/k is 1000*sqrt(512/k/32) = 4000/sqrt(k): k=1 needs 4000
    # (6000+4000 fits exactly), so no accumulation is needed
    assert start.accum_steps == 1
    tighter = TablePerf(mem_mb={"a": 1000.0, "b": 7000.0})
    snap = snapshot(
        cl, tighter, [pending("a", 50, batch=512)], [running("r", 100, (0,), model="b")]
    )
    (start,) = SjfBsbf().decide(snap).starts
    # 3000 MiB left: 4000/sqrt(k) <= 3000 first holds at k=2 (2828)
    assert start.accum_steps == 2


def test_a_job_that_forbids_sharing_waits_with_a_reason_saying_so():
    perf = TablePerf()
    snap = snapshot(cluster(1, 1), perf, [pending("a", 5, share=False)], [running("r", 50, (0,))])
    decision = SjfBsbf().decide(snap)
    assert decision.starts == ()
    assert "does not allow sharing" in decision.why("a")


def test_every_pending_job_gets_a_readable_reason():
    perf = TablePerf(default_slowdown=3.0)
    snap = snapshot(
        cluster(1, 1),
        perf,
        [pending("a", 5), pending("b", 6), pending("c", 7)],
        [running("r", 1, (0,))],
    )
    decision = SjfBsbf().decide(snap)
    assert decision.starts == ()
    for job_id in ("a", "b", "c"):
        assert "GPU" in decision.why(job_id)


@given(
    e_a=st.floats(min_value=1.0, max_value=1e4),
    x_a=slowdowns,
    x_b=slowdowns,
    stretch=st.sampled_from([1.0, 1.1, 1.5, 2.0, 4.0]),
    residents=st.lists(st.floats(min_value=0.01, max_value=1e5), min_size=1, max_size=12),
)
def test_a_group_offers_exactly_the_residents_sharing_with_pays(e_a, x_a, x_b, stretch, residents):
    window = BenefitWindow.of(e_a, e_a * stretch, x_a, x_b)
    group = SlotGroup(key=("m",), resident=None, mem_used_mb=0.0, gpu_mem_mb=1)  # type: ignore[arg-type]
    group.remaining = sorted(residents)
    offered = set(group.indices(window))
    for i, e_b in enumerate(group.remaining):
        t_con = t_concurrent(e_a * stretch, e_b, x_a, x_b)
        t_seq = t_sequential(e_a, e_b)
        if abs(t_con - t_seq) > 1e-9 * (e_a + e_b) * stretch * x_a * x_b:
            assert (i in offered) == (t_con < t_seq), (e_b, window)


# A (model a) beside B (model b): A runs 1.2x slower, B 2.0x slower
CAPPED_PERF = TablePerf(
    slowdown={("a", "b"): 1.2, ("b", "a"): 2.0, ("a", "c"): 1.2, ("c", "a"): 1.1}
)


def test_a_cap_on_the_residents_slowdown_refuses_a_partner_the_rule_would_share_with():
    snap = snapshot(cluster(1, 1), CAPPED_PERF, [pending("a", 5)], [running("r", 100, (0,), "b")])
    # t_seq = 100 + 5/2 = 102.5; A finishes first: t_con = 100/2 + (1 - 1/4) * 1.2 * 5 = 54.5
    (start,) = SjfBsbf().decide(snap).starts
    assert start.shares_with == ("r",)
    (start,) = SjfBsbf(max_resident_slowdown=2.0).decide(snap).starts  # the cap is inclusive
    assert start.shares_with == ("r",)
    capped = SjfBsbf(max_resident_slowdown=1.5).decide(snap)
    assert capped.starts == ()
    assert "more than 1.5x (max_resident_slowdown)" in capped.why("a")


def test_a_cap_steers_a_job_to_the_resident_it_slows_less_even_at_a_higher_t_con():
    residents = [running("slowed", 30, (0,), "b"), running("spared", 60, (1,), "c")]
    snap = snapshot(cluster(1, 2), CAPPED_PERF, [pending("a", 5)], residents)
    # beside "slowed": 30/2 + 0.75 * 6 = 19.5; beside "spared": 60/2 + (1 - 1/2.2) * 6 = 33.3
    (start,) = SjfBsbf().decide(snap).starts
    assert start.shares_with == ("slowed",)
    (start,) = SjfBsbf(max_resident_slowdown=1.5).decide(snap).starts
    assert start.shares_with == ("spared",)


@pytest.mark.parametrize("cap", [0.5, -1.0, float("nan"), "2"])
def test_a_cap_below_one_is_refused_naming_the_field(cap):
    with pytest.raises(ValueError, match="max_resident_slowdown"):
        SjfBsbf(max_resident_slowdown=cap)


def test_make_policy_gives_the_cap_to_the_sharing_policies_only():
    assert make_policy("sjf-bsbf", max_resident_slowdown=1.5).max_resident_slowdown == 1.5
    assert make_policy("sjf-ffs", max_resident_slowdown=1.5).max_resident_slowdown == 1.5
    assert make_policy("sjf-bsbf").max_resident_slowdown is None
    assert not hasattr(make_policy("tiresias", max_resident_slowdown=1.5), "max_resident_slowdown")
