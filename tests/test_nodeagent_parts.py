"""The node agent's parts without NATS: settings, the command types, GPUs, the
simulated clock, the progress file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpusched.libs.common import codec
from gpusched.libs.common.schemas import (
    Command,
    GpuTelemetry,
    JobSpec,
    ResizeJob,
    StartJob,
    StopJob,
)
from gpusched.services.nodeagent.checks import gpu_ranges
from gpusched.services.nodeagent.config import NodeAgentConfig, default_node_name
from gpusched.services.nodeagent.gpus import (
    DEFAULT_EMULATED_GPUS,
    NvmlGpu,
    discover,
    emulated_gpus,
    emulated_telemetry,
)
from gpusched.services.nodeagent.runs import ProgressTail, SimulatedProgress

# ---- settings -------------------------------------------------------------------------


def test_gpu_memory_is_read_from_the_gpu_model_name():
    assert NodeAgentConfig(name="n", gpu_model="V100-32GB").gpu_mem_mb == 32768
    assert NodeAgentConfig(name="n", gpu_model="A100-80GB").gpu_mem_mb == 81920
    assert NodeAgentConfig(name="n", gpu_model="T4", gpu_mem_mb=15360).gpu_mem_mb == 15360


def test_a_gpu_model_without_memory_in_its_name_needs_gpu_mem_mb():
    with pytest.raises(ValueError, match="gpu_mem_mb"):
        NodeAgentConfig(name="n", gpu_model="T4")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", "gpu01.example.com"),
        ("name", ""),
        ("gpus", 0),
        ("time_scale", 0.0),
        ("heartbeat_s", -1.0),
        ("jobs_mode", "threads"),
        ("nats_url", "localhost:4222"),
        ("cpus", 0),
        ("metrics_port", 70000),
    ],
)
def test_a_bad_setting_is_refused_naming_its_field(field: str, value: object):
    settings: dict[str, object] = {"name": "n", field: value}
    with pytest.raises(ValueError, match=rf"^{field}:"):
        NodeAgentConfig(**settings)  # type: ignore[arg-type]


def test_a_data_dir_that_is_missing_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="data_dir"):
        NodeAgentConfig(name="n", data_dir=tmp_path / "absent")


def test_settings_come_from_the_environment(tmp_path: Path):
    config = NodeAgentConfig.from_env(
        {
            "NATS_URL": "nats://10.0.0.1:4222",
            "GPUSCHED_NODE_NAME": "gpu-7",
            "GPUSCHED_NODE_GPUS": "4",
            "GPUSCHED_NODE_GPU_MODEL": "A100-40GB",
            "GPUSCHED_JOBS_MODE": "process",
            "GPUSCHED_TIME_SCALE": "0.01",
            "GPUSCHED_WORK_DIR": str(tmp_path),
            "GPUSCHED_NODEAGENT_HEARTBEAT_S": "",
        }
    )
    assert (config.nats_url, config.name, config.gpus) == ("nats://10.0.0.1:4222", "gpu-7", 4)
    assert (config.gpu_mem_mb, config.jobs_mode, config.time_scale) == (40960, "process", 0.01)
    assert config.work_dir == tmp_path and config.heartbeat_s == 1.0


def test_an_unparsable_environment_variable_is_named():
    with pytest.raises(ValueError, match="GPUSCHED_NODE_GPUS"):
        NodeAgentConfig.from_env({"GPUSCHED_NODE_GPUS": "eight"})


def test_the_default_node_name_is_safe_inside_a_subject():
    name = default_node_name()
    assert name and not any(c in name for c in ".*> ")


# ---- GPUs -------------------------------------------------------------------------------


def test_emulated_gpus_have_deterministic_distinct_uuids():
    first = emulated_gpus("node-1", 4, "V100-32GB", 32768)
    again = emulated_gpus("node-1", 4, "V100-32GB", 32768)
    other = emulated_gpus("node-2", 4, "V100-32GB", 32768)
    assert [g.uuid for g in first] == [g.uuid for g in again]
    assert len({g.uuid for g in first} | {g.uuid for g in other}) == 8
    assert all(g.uuid.startswith("GPU-") and g.memory_mb == 32768 for g in first)


def test_discovery_prefers_real_gpus_and_falls_back_to_emulation():
    real = [NvmlGpu(0, "GPU-real", "NVIDIA H100", 81559.0, 10.0, 81549.0, 0.0, 70.0, 30.0)]
    found = discover("n", None, "V100-32GB", 32768, real)
    assert not found.emulated and found.gpus[0].uuid == "GPU-real"
    assert found.gpus[0].memory_mb == 81559
    assert discover("n", None, "V100-32GB", 32768, None).emulated
    assert len(discover("n", None, "V100-32GB", 32768, []).gpus) == DEFAULT_EMULATED_GPUS
    # an explicit count emulates even where real GPUs exist
    assert discover("n", 2, "V100-32GB", 32768, real).emulated


def test_emulated_telemetry_follows_occupancy_and_caps_memory_at_the_board():
    gpus = emulated_gpus("n", 3, "V100-32GB", 32768)
    idle, busy, full = emulated_telemetry(gpus, {1: 11400.0, 2: 50000.0}, busy={1, 2})
    assert (idle.util, idle.fb_used_mib, idle.fb_free_mib) == (0.0, 0.0, 32768.0)
    assert (busy.util, busy.fb_used_mib, busy.fb_free_mib) == (100.0, 11400.0, 21368.0)
    assert (full.fb_used_mib, full.fb_free_mib) == (32768.0, 0.0)
    assert busy.power_w > idle.power_w and busy.temp_c > idle.temp_c
    assert all(isinstance(s, GpuTelemetry) and 0 < s.power_w <= 300 for s in (idle, busy))


# ---- the simulated clock ---------------------------------------------------------------


def test_a_simulated_clock_advances_at_its_speed_and_stops_at_the_total():
    clock = SimulatedProgress(start=10, total=20, wall_iteration_s=0.5, now=100.0)
    assert clock.at(100.0) == 10 and clock.at(102.0) == 14
    assert clock.finishes_at() == 105.0
    clock.change_speed(1.0, now=102.0)  # twice as slow from iteration 14
    assert clock.at(104.0) == 16 and clock.finishes_at() == 108.0
    assert clock.at(1000.0) == 20


# ---- the progress file -----------------------------------------------------------------


def test_the_progress_tail_reads_only_complete_new_lines(tmp_path: Path):
    path = tmp_path / "progress.jsonl"
    tail = ProgressTail(path)
    assert tail.read() == []
    with path.open("a") as f:
        f.write('{"event":"progress","iteration":1,"samples_per_s":10.0,"at":1.0}\n')
        f.write('{"event":"checkpoint","iteration":2')
    assert [line.iteration for line in tail.read()] == [1]
    with path.open("a") as f:
        f.write(',"loss":0.5}\nnot json\n{"event":"done","iteration":3}\n')
    lines = tail.read()
    assert [(line.event, line.iteration) for line in lines] == [("checkpoint", 2), ("done", 3)]
    assert lines[0].loss == 0.5 and tail.bad_lines == 1


def test_gpu_index_lists_read_as_ranges():
    assert gpu_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert gpu_ranges([]) == "none"


# ---- command types --------------------------------------------------------------------

SPEC = JobSpec(name="j", model="resnet50", batch_size=64, iterations=100)
VALID: list[Command] = [
    StartJob(job_id="j", run_id=1, spec=SPEC, total_iterations=100, gpus=[0, 1]),
    StopJob(job_id="j", run_id=1, reason="preempt"),
    ResizeJob(job_id="j", run_id=1, new_run_id=2, gpus=[0], batch_size=64),
]
#: one field broken at a time, and where the error says it is
BROKEN: list[tuple[dict[str, Any], str]] = [
    ({"job_id": "a.b"}, "$.job_id"),
    ({"job_id": ""}, "$.job_id"),
    ({"run_id": 0}, "$.run_id"),
    ({"gpus": []}, "$.gpus"),
    ({"gpus": [0, -1]}, "$.gpus[1]"),
    ({"accum_steps": 0}, "$.accum_steps"),
    ({"co_runners": ["x.y"]}, "$.co_runners[0]"),
]
START_ONLY: list[tuple[dict[str, Any], str]] = [
    ({"total_iterations": 0}, "$.total_iterations"),
    ({"resume_iteration": -1}, "$.resume_iteration"),
    ({"nodes": 0}, "$.nodes"),
    ({"emulated_iteration_s": 0.0}, "$.emulated_iteration_s"),
    ({"first_rank": -1}, "$.first_rank"),
]
RESIZE_ONLY: list[tuple[dict[str, Any], str]] = [
    ({"new_run_id": 0}, "$.new_run_id"),
    ({"batch_size": 0}, "$.batch_size"),
    ({"accum_steps": 10**7}, "$.accum_steps"),
]


def broken_commands() -> list[tuple[Command, dict[str, Any], str]]:
    cases = []
    for command in VALID:
        fields = set(msgspec.structs.asdict(command))
        extra = {StartJob: START_ONLY, ResizeJob: RESIZE_ONLY}.get(type(command), [])
        for changes, where in [*BROKEN, *extra]:
            if set(changes) <= fields:
                cases.append((command, changes, where))
    return cases


@pytest.mark.parametrize(("command", "changes", "where"), broken_commands())
def test_a_command_breaking_a_constraint_can_be_neither_built_nor_decoded(
    command: Command, changes: dict[str, Any], where: str
):
    with pytest.raises(msgspec.ValidationError, match=re.escape(f"at `{where}`")):
        msgspec.structs.replace(command, **changes)
    tag = str(command.__struct_config__.tag)
    wire = codec.encode({"type": tag, **msgspec.structs.asdict(command), **changes})
    with pytest.raises(msgspec.ValidationError, match=changes and next(iter(changes))):
        codec.decode(wire, Command)  # type: ignore[arg-type]


def test_a_stop_reason_outside_the_three_is_not_decoded():
    wire = codec.encode({"type": "stop", "job_id": "j", "run_id": 1, "reason": "bored"})
    with pytest.raises(msgspec.ValidationError, match="reason"):
        codec.decode(wire, Command)  # type: ignore[arg-type]
    assert codec.decode(codec.encode(VALID[1]), Command) == VALID[1]  # type: ignore[arg-type]
