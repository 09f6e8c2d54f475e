"""What each policy declares to its drivers (``Capabilities`` and the protocols beside
it), and how ``make_policy`` and the simulator read them."""

from __future__ import annotations

import pytest

from gpusched.services.scheduler.policies import (
    POLICIES,
    RESIDENT_CAP_POLICIES,
    Capabilities,
    ReportsRho,
    ResidentCapped,
    Scalable,
    honours_priority,
    make_policy,
)
from gpusched.services.scheduler.policies.preemptive import Tiresias
from gpusched.services.scheduler.simulation.simulator import simulate
from tests.builders import TablePerf, cluster, job

PERF = TablePerf()


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_declares_its_capabilities(name: str) -> None:
    can = make_policy(name).capabilities
    assert isinstance(can, Capabilities)
    assert can.honours_priority == (name != "ones")
    # auto sizes the jobs that declare elastic bounds with ONES's search
    assert can.predicts_progress == (name in ("ones", "auto"))
    assert can.resizes == (name in ("ones", "auto"))
    assert can.shares_gpus == (name in ("sjf-ffs", "sjf-bsbf"))
    assert can.tunes_cpu_mem == name.startswith("synergy-")
    assert (can.without_deadlines is not None) == (name in ("edf", "genie", "auto"))
    assert bool(can.extra_sorts) == (name in ("tiresias", "auto"))


def test_the_protocols_name_what_takes_an_argument_or_changes_during_a_run() -> None:
    assert RESIDENT_CAP_POLICIES == ("sjf-ffs", "sjf-bsbf", "auto")
    assert all(isinstance(make_policy(n), ResidentCapped) for n in RESIDENT_CAP_POLICIES)
    scalable = {n for n in POLICIES if isinstance(make_policy(n), Scalable)}
    assert scalable == {"tiresias", "ones", "auto"}
    assert {n for n in POLICIES if isinstance(make_policy(n), ReportsRho)} == {"asrpt"}
    assert not honours_priority(make_policy("ones"))


def test_make_policy_scales_a_scalable_policy_and_caps_a_sharing_one() -> None:
    tiresias = make_policy("tiresias", time_scale=0.5)
    assert isinstance(tiresias, Tiresias)
    assert tiresias.thresholds_gpu_s == (1_800.0, 18_000.0)
    assert make_policy("fifo", time_scale=0.5) == make_policy("fifo")
    capped = make_policy("sjf-bsbf", max_resident_slowdown=1.5)
    assert isinstance(capped, ResidentCapped) and capped.max_resident_slowdown == 1.5


def test_the_simulator_reports_the_cap_and_rho_of_the_policies_that_have_them() -> None:
    trace = [job("a", 0, 10), job("b", 1, 10)]
    results = {
        name: simulate(cluster(1, 2), trace, make_policy(name, max_resident_slowdown=2.0), PERF)
        for name in ("fifo", "sjf-bsbf", "asrpt")
    }
    assert results["sjf-bsbf"].max_resident_slowdown == 2.0
    assert results["fifo"].max_resident_slowdown is None
    assert results["asrpt"].rho == 1.0
    assert results["fifo"].rho is None and results["sjf-bsbf"].rho is None
