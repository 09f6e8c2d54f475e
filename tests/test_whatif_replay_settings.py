"""`gpusched history whatif`'s replay settings: the restart overhead, rounds and the
delay from a submission to the policy (services/cli/whatif.py), with defaults that
replay as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_whatif import export, table, whatif


def mean_jct(said: str, policy: str) -> float:
    return next(mean for name, _, _, mean in table(said) if name == policy)


def test_the_defaults_are_the_simulators_and_are_said(tmp_path: Path):
    code, said, err = whatif(str(export(tmp_path)), "--policy", "fifo")
    assert code == 0, err
    assert ("replay: restart overhead 30 s, policy called on events only, jobs reach it "
            "0 s after submission") in " ".join(said.split())


def test_a_decision_delay_adds_itself_to_every_fifo_job_that_waits_for_nothing_else(
    tmp_path: Path,
):
    trace = str(export(tmp_path))
    code, plain, err = whatif(trace, "--policy", "fifo")
    assert code == 0, err
    # every arrival moves by the same 50 s: fifo decides the same, 50 s later
    code, late, err = whatif(trace, "--policy", "fifo", "--decision-delay-s", "50")
    assert code == 0, err
    assert mean_jct(late, "fifo") == pytest.approx(mean_jct(plain, "fifo") + 50, abs=0.1)
    assert "jobs reach it 50 s after submission" in " ".join(late.split())


def test_rounds_and_the_restart_overhead_are_passed_and_said(tmp_path: Path):
    code, said, err = whatif(str(export(tmp_path)), "--policy", "fifo,tiresias",
                             "--round-s", "100", "--restart-overhead-s", "0")
    assert code == 0, err
    assert [r[0] for r in table(said)] == ["live (fifo)", "fifo", "tiresias"]
    assert ("replay: restart overhead 0 s, policy called on events and every 100 s"
            in " ".join(said.split()))


@pytest.mark.parametrize(("option", "value", "named"), [
    ("--round-s", "0", "--round-s"),
    ("--restart-overhead-s", "-1", "--restart-overhead-s"),
    ("--decision-delay-s", "-5", "--decision-delay-s"),
    ("--decision-delay-s", "inf", "--decision-delay-s"),
])
def test_a_bad_setting_names_its_option(tmp_path: Path, option: str, value: str, named: str):
    code, said, err = whatif(str(export(tmp_path)), "--policy", "fifo", option, value)
    assert code == 2
    assert named in err + said
