"""Trace loaders, the native format, and turning trace jobs into runnable jobs."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.libs.core.jobs import JobSpec
from gpusched.libs.core.traces import (
    ALIBABA_GPU_MEM_GB,
    FORMATS,
    LoadedTrace,
    TraceError,
    TraceJob,
    load_alibaba_nodes,
    load_trace,
    write_native,
)
from gpusched.libs.core.workload import (
    MODEL_CATEGORIES,
    MODEL_MIX,
    materialize,
    parse_mix,
    synthetic,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TRACES = DATA / "traces"


def need_data() -> None:
    if not DATA.is_dir():
        pytest.skip(f"../shared/data is absent: research traces are not shipped ({DATA})")


class TinyPerf:
    """A performance model just rich enough for materialize: linear in batch / GPUs."""

    def __init__(self, models: tuple[str, ...] | None = None) -> None:
        every = tuple(m for group in MODEL_CATEGORIES.values() for m in group)
        self._models = models if models is not None else every

    def models(self) -> tuple[str, ...]:
        return self._models

    def default_batch_size(self, model: str) -> int:
        return 64 if len(model) % 2 else 32

    def iteration_time(
        self, model: str, batch_size: int, gpus: int, nodes: int, accum_steps: int = 1
    ) -> float:
        return 0.001 * batch_size / gpus * (1 + 0.2 * (nodes - 1)) + 0.01 * accum_steps

    def colocation_slowdown(self, *args: object) -> float:
        return 1.5

    def gpu_memory_mb(self, model: str, per_gpu_batch: float) -> float:
        return 1000 + 10 * per_gpu_batch

    def cpu_mem_speedup(
        self, model: str, gpus: int, cpus_per_gpu: float, mem_gb_per_gpu: float
    ) -> float:
        return 1.0


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def assert_sorted_from_zero(trace: LoadedTrace) -> None:
    times = [j.submit_time for j in trace.jobs]
    assert times[0] == 0
    assert times == sorted(times)


# ---------------------------------------------------------------- real research files


def test_philly_loads_all_82247_jobs_sorted_from_zero() -> None:
    need_data()
    trace = load_trace(TRACES / "philly" / "philly.csv", "philly")
    assert len(trace.jobs) == 82_247
    assert_sorted_from_zero(trace)
    assert all(j.gpus >= 1 and j.duration_s is not None and j.duration_s > 0 for j in trace.jobs)
    assert all(j.model is None and j.user for j in trace.jobs)
    assert len({j.job_id for j in trace.jobs}) == 82_247
    assert {j.gpus for j in trace.jobs} >= {1, 2, 4, 8, 16}
    # about 109 days of submissions
    assert 100 * 86400 < trace.jobs[-1].submit_time < 120 * 86400


def test_philly_limit_keeps_the_earliest_jobs() -> None:
    need_data()
    first = load_trace(TRACES / "philly" / "philly.csv", "philly", limit=100)
    assert len(first.jobs) == 100
    assert_sorted_from_zero(first)
    # the file is unsorted: the earliest job sits on line 31,568, not near the top
    assert first.jobs[0].job_id == "philly-31568"
    assert any("first 100 jobs" in n for n in first.notes)


def test_alibaba_default_pods_keep_gpu_pods_and_count_the_rest() -> None:
    need_data()
    trace = load_trace(TRACES / "alibaba-v2023" / "openb_pod_list_default.csv", "alibaba")
    assert len(trace.jobs) == 6_203
    assert trace.filtered == {
        "no GPU (num_gpu = 0)": 1_088,
        "never scheduled (no scheduled_time)": 861,
    }
    assert trace.skipped_rows == 0
    assert_sorted_from_zero(trace)
    shared = [j for j in trace.jobs if j.allow_sharing]
    assert shared and all(j.gpus == 1 for j in shared)
    assert all(j.cpus_per_gpu and j.duration_s for j in trace.jobs)
    assert sum(j.mem_gb_per_gpu is None for j in trace.jobs) == 1  # one pod states no memory
    assert {j.gpus for j in trace.jobs} == {1, 2, 4, 8}


def test_alibaba_folder_means_the_default_pod_list() -> None:
    need_data()
    by_folder = load_trace(TRACES / "alibaba-v2023", "alibaba")
    assert len(by_folder.jobs) == 6_203


def test_alibaba_gpushare_pod_list_loads() -> None:
    need_data()
    trace = load_trace(TRACES / "alibaba-v2023" / "openb_pod_list_gpushare100.csv", "alibaba")
    assert len(trace.jobs) + sum(trace.filtered.values()) == 8_152
    assert sum(j.allow_sharing for j in trace.jobs) > len(trace.jobs) / 2


def test_alibaba_pod_list_without_times_is_refused_clearly() -> None:
    need_data()
    with pytest.raises(ValueError, match=r"no timing columns"):
        load_trace(TRACES / "alibaba-v2023" / "openb_pod_list_multigpu50.csv", "alibaba")


def test_alibaba_node_list_gives_1213_gpu_nodes_of_known_models() -> None:
    need_data()
    cluster = load_alibaba_nodes(TRACES / "alibaba-v2023" / "openb_node_list_gpu_node.csv")
    assert len(cluster.nodes) == 1_213
    assert {n.gpu_model for n in cluster.nodes} <= set(ALIBABA_GPU_MEM_GB)
    v100 = next(n for n in cluster.nodes if n.gpu_model == "V100M32")
    assert v100.gpu_mem_mb == 32 * 1024
    assert all(n.gpus >= 1 and n.cpus >= 1 and n.host_mem_gb > 0 for n in cluster.nodes)


def test_every_pollux_workload_loads_one_job_per_row() -> None:
    need_data()
    files = sorted(TRACES.glob("pollux-workloads/*/workload-*.csv"))
    assert len(files) >= 4
    for path in files:
        rows = sum(1 for line in path.read_text().splitlines()[1:] if line.strip())
        trace = load_trace(path, "pollux")
        assert len(trace.jobs) == rows
        assert_sorted_from_zero(trace)
        assert all(j.model and j.batch_size and j.iterations for j in trace.jobs)
        # adaptive jobs: each declares itself elastic, one GPU at least
        assert {(j.min_gpus, j.max_gpus) for j in trace.jobs} == {(1, None)}


def test_pollux_iterations_come_from_the_nearest_progress_trace_with_a_data_dir() -> None:
    need_data()
    path = TRACES / "pollux-workloads" / "workloads" / "workload-1.csv"
    trace = load_trace(path, "pollux", data_dir=DATA)
    assert any("from profiles" in n for n in trace.notes)
    cifar = next(j for j in trace.jobs if j.model == "cifar10" and j.batch_size == 2048)
    last = (DATA / "profiles/pollux/cifar10/validation-2048.csv").read_text().split()[-1]
    assert cifar.iterations == int(last.split(",")[1])
    defaults = load_trace(path, "pollux")
    assert any("built-in defaults" in n for n in defaults.notes)


def test_a_relative_trace_path_is_found_inside_the_data_dir() -> None:
    need_data()
    trace = load_trace("traces/pollux-workloads/workloads/workload-1.csv", "pollux", data_dir=DATA)
    assert len(trace.jobs) == 160


# ------------------------------------------------------------------------ bad input


PHILLY_HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"


def test_a_malformed_philly_row_names_file_line_and_field(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "philly.csv",
        PHILLY_HEADER
        + "2017-10-09 07:01:55,66.0,1,66.0,a\n"
        + "2017-10-09 07:02:55,66.0,abc,66.0,a\n",
    )
    with pytest.raises(TraceError) as err:
        load_trace(path, "philly")
    message = str(err.value)
    assert "philly.csv:3:" in message
    assert "field 'num_gpus'" in message
    assert "'abc'" in message


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ("yesterday,66.0,1,66.0,a", "timestamp"),
        ("2017-10-09 07:01:55,-5,1,66.0,a", "duration"),
        ("2017-10-09 07:01:55,0,1,0,a", "duration"),
        ("2017-10-09 07:01:55,nan,1,0,a", "duration"),
        ("2017-10-09 07:01:55,66.0,0,66.0,a", "num_gpus"),
        ("2017-10-09 07:01:55,66.0", "num_gpus"),
    ],
)
def test_each_kind_of_bad_philly_value_is_reported_by_field(
    tmp_path: Path, row: str, field: str
) -> None:
    path = write(tmp_path, "philly.csv", PHILLY_HEADER + row + "\n")
    with pytest.raises(TraceError, match=f"philly.csv:2: field '{field}'"):
        load_trace(path, "philly")


def test_skip_bad_rows_counts_and_drops_malformed_rows(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "philly.csv",
        PHILLY_HEADER
        + "2017-10-09 07:01:55,66.0,1,66.0,a\n"
        + "2017-10-09 07:02:55,66.0,abc,66.0,a\n"
        + "\n"
        + "2017-10-09 07:03:55,x,1,66.0,a\n"
        + "2017-10-09 07:00:55,10,2,20,b\n",
    )
    trace = load_trace(path, "philly", skip_bad_rows=True)
    assert trace.skipped_rows == 2
    assert [j.job_id for j in trace.jobs] == ["philly-6", "philly-2"]
    assert [j.submit_time for j in trace.jobs] == [0.0, 60.0]
    assert any("skipped 2" in n for n in trace.notes)


def test_a_missing_file_names_its_path(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nowhere.csv"):
        load_trace(tmp_path / "nowhere.csv", "philly")


def test_a_file_that_is_not_utf8_text_is_named(tmp_path: Path) -> None:
    path = tmp_path / "philly.csv"
    path.write_bytes(PHILLY_HEADER.encode() + b"2017-10-09 07:01:55,6\xff,1,6,a\n")
    with pytest.raises(TraceError, match=r"philly.csv: not readable as UTF-8"):
        load_trace(path, "philly", skip_bad_rows=True)


def test_an_unknown_format_lists_the_valid_ones(tmp_path: Path) -> None:
    path = write(tmp_path, "x.csv", PHILLY_HEADER)
    with pytest.raises(ValueError) as err:
        load_trace(path, "slurm")
    assert all(name in str(err.value) for name in FORMATS)


def test_a_missing_column_is_reported_at_the_header(tmp_path: Path) -> None:
    path = write(tmp_path, "p.csv", "timestamp,duration,cluster\n")
    with pytest.raises(TraceError, match=r"p.csv:1: missing column\(s\) 'gpu_time', 'num_gpus'"):
        load_trace(path, "philly")


def test_a_bad_alibaba_row_names_its_field(tmp_path: Path) -> None:
    header = (
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
        "creation_time,deletion_time,scheduled_time\n"
    )
    path = write(
        tmp_path,
        "pods.csv",
        header
        + "p0,8000,16384,2,1000,,LS,Running,10,100,20\n"
        + "p1,8000,16384,0,0,,LS,Running,10,100,20\n"
        + "p2,8000,16384,1,500,,BE,Running,30,25,40\n",
    )
    with pytest.raises(TraceError, match=r"pods.csv:4: field 'deletion_time'"):
        load_trace(path, "alibaba")
    trace = load_trace(path, "alibaba", skip_bad_rows=True)
    assert trace.skipped_rows == 1
    assert trace.filtered == {"no GPU (num_gpu = 0)": 1}
    (job,) = trace.jobs
    assert (job.gpus, job.duration_s, job.cpus_per_gpu, job.mem_gb_per_gpu) == (2, 80, 4, 8)
    assert not job.allow_sharing


# ---------------------------------------------------------------------- native format

NATIVE_HEADER = "job_id,submit_time,gpus,model,batch_size,duration_s,iterations,allow_sharing\n"


def test_native_csv_defaults_and_relative_deadlines(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "jobs.csv",
        "submit_time,gpus,duration_s,iterations,deadline,user\n"
        "100,2,3600,,7200,alice\n"
        "50,1,,500,,\n",
    )
    trace = load_trace(path, "native")
    first, second = trace.jobs
    assert (first.job_id, first.submit_time, first.iterations) == ("job-3", 0.0, 500)
    assert first.allow_sharing and first.model is None and first.user == ""
    assert (second.job_id, second.submit_time, second.deadline) == ("job-2", 50.0, 7250.0)


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ("a,0,1,bert,32,10,5,true", "duration_s"),
        ("a,0,1,bert,32,,,true", "duration_s"),
        ("a,,1,bert,32,10,,true", "submit_time"),
        ("a,0,1,bert,32,10,,maybe", "allow_sharing"),
        ("a.b,0,1,bert,32,10,,true", "job_id"),
        ("a,0,1,bert,0,10,,true", "batch_size"),
    ],
)
def test_bad_native_csv_rows_name_their_field(tmp_path: Path, row: str, field: str) -> None:
    path = write(tmp_path, "jobs.csv", NATIVE_HEADER + row + "\n")
    with pytest.raises(TraceError, match=f"jobs.csv:2: field '{field}'"):
        load_trace(path, "native")


def test_native_csv_rejects_unknown_columns_by_name(tmp_path: Path) -> None:
    path = write(tmp_path, "jobs.csv", "submit_time,gpus,duration_s,urgency,colour\n0,1,5,1,red\n")
    with pytest.raises(TraceError, match=r"unknown column.*'colour', 'urgency'"):
        load_trace(path, "native")


def test_native_jsonl_rejects_unknown_keys_and_bad_lines(tmp_path: Path) -> None:
    good = {"submit_time": 0, "gpus": 1, "iterations": 10}
    lines = [
        json.dumps(good),
        json.dumps({**good, "urgency": 3}),
        "{not json",
        "[1, 2]",
        json.dumps({**good, "gpus": 1.5}),
    ]
    path = write(tmp_path, "jobs.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=r"jobs.jsonl:2: field 'urgency': unknown key"):
        load_trace(path, "native")
    trace = load_trace(path, "native", skip_bad_rows=True)
    assert trace.skipped_rows == 4
    assert [j.job_id for j in trace.jobs] == ["job-1"]


def test_native_rejects_duplicate_job_ids(tmp_path: Path) -> None:
    path = write(tmp_path, "jobs.csv", NATIVE_HEADER + "a,0,1,,,10,,\na,5,1,,,10,,\n")
    with pytest.raises(TraceError, match=r"jobs.csv:3: field 'job_id': duplicate.*line 2"):
        load_trace(path, "native")


def test_native_needs_a_known_extension(tmp_path: Path) -> None:
    path = write(tmp_path, "jobs.txt", NATIVE_HEADER)
    with pytest.raises(TraceError, match=r"\.csv"):
        load_trace(path, "native")


def sample_jobs() -> list[TraceJob]:
    jobs = synthetic(40, seed=3, arrival_rate_per_h=10)
    extra = [
        TraceJob("with-all", 7.25, 4, "bert", 96, None, 1234, False, 1000.5, 'a, "b"', 2.5, 31.25),
        TraceJob("frac", 0.1 + 0.2, 1, None, None, 1e-3, None, True, None, "", None, None),
    ]
    return sorted(jobs + extra, key=lambda j: j.submit_time)


@pytest.mark.parametrize("name", ["jobs.csv", "jobs.jsonl", "jobs.ndjson"])
def test_native_files_round_trip(tmp_path: Path, name: str) -> None:
    jobs = sample_jobs()
    write_native(tmp_path / name, jobs)
    loaded = load_trace(tmp_path / name, "native").jobs

    def key(j: TraceJob) -> TraceJob:
        # deadlines travel as offsets from submission, so allow for float rounding
        deadline = None if j.deadline is None else round(j.deadline, 6)
        return dataclasses.replace(j, line=0, deadline=deadline)

    assert [key(j) for j in loaded] == [key(j) for j in jobs]


# ------------------------------------------------------------------------ materialize


def test_materialize_is_deterministic_per_seed_and_differs_across_seeds() -> None:
    jobs = synthetic(300, seed=1, arrival_rate_per_h=20)
    bare = [dataclasses.replace(j, model=None) for j in jobs]
    perf = TinyPerf()
    one = materialize(bare, perf, seed=7)
    assert one == materialize(bare, perf, seed=7)
    assert [s.model for s in one] != [s.model for s in materialize(bare, perf, seed=8)]
    assert all(isinstance(s, JobSpec) for s in one)


def test_materialize_keeps_given_models_and_fills_batch_and_iterations() -> None:
    job = TraceJob("j", 0.0, 8, model="bert", duration_s=1000.0)
    (spec,) = materialize([job], TinyPerf(), seed=0)
    assert spec.model == "bert" and spec.batch_size == 32
    # not rounded, so the job alone takes exactly the 1000 s
    assert spec.iterations == 1000.0 / TinyPerf().iteration_time("bert", 32, 8, 1)
    wide = TraceJob("w", 0.0, 16, model="bert", batch_size=4, iterations=10)
    (spec,) = materialize([wide], TinyPerf(), seed=0)
    assert (spec.batch_size, spec.iterations) == (16, 10)


def test_materialize_rejects_unknown_models_listing_valid_ones() -> None:
    job = TraceJob("j", 0.0, 1, model="alexnet", iterations=5)
    with pytest.raises(ValueError, match=r"unknown model 'alexnet'.*valid models: a, b"):
        materialize([job], TinyPerf(("b", "a")), seed=0)
    bare = TraceJob("k", 0.0, 1, iterations=5)
    with pytest.raises(ValueError, match=r"mix names models .*valid models: a, b"):
        materialize([bare], TinyPerf(("b", "a")), seed=0)
    (spec,) = materialize([bare], TinyPerf(("b", "a")), seed=0, mix={"a": 1})
    assert spec.model == "a"


def test_the_default_mix_is_respected_on_10000_jobs() -> None:
    bare = [TraceJob(f"j{i}", float(i), 1, duration_s=60.0) for i in range(10_000)]
    specs = materialize(bare, TinyPerf(), seed=11)
    category = {m: c for c, models in MODEL_CATEGORIES.items() for m in models}
    shares = Counter(category[s.model] for s in specs)
    assert shares["image"] / 10_000 == pytest.approx(0.2, abs=0.02)
    assert shares["language"] / 10_000 == pytest.approx(0.7, abs=0.02)
    assert shares["speech"] / 10_000 == pytest.approx(0.1, abs=0.02)
    assert math.isclose(sum(MODEL_MIX.values()), 1.0)


def test_parse_mix_reads_categories_and_models() -> None:
    assert parse_mix("image=20,language=70,speech=10") == pytest.approx(
        {m: w * 100 for m, w in MODEL_MIX.items()}
    )
    assert parse_mix("resnet50=1, bert=3") == {"resnet50": 1.0, "bert": 3.0}
    with pytest.raises(ValueError):
        parse_mix("bert")
    with pytest.raises(ValueError):
        parse_mix("bert=-1")


# -------------------------------------------------------------------------- synthetic


def test_synthetic_arrivals_are_sorted_deterministic_and_poisson_paced() -> None:
    jobs = synthetic(2_000, seed=5, arrival_rate_per_h=12)
    assert jobs == synthetic(2_000, seed=5, arrival_rate_per_h=12)
    assert jobs != synthetic(2_000, seed=6, arrival_rate_per_h=12)
    times = [j.submit_time for j in jobs]
    assert times[0] == 0 and times == sorted(times)
    assert times[-1] / 1_999 == pytest.approx(300, rel=0.1)
    durations = sorted(j.duration_s or 0 for j in jobs)
    assert durations[1_000] == pytest.approx(3600, rel=0.2)
    assert Counter(j.gpus for j in jobs)[1] / 2_000 == pytest.approx(0.7, abs=0.04)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 256),
            st.one_of(st.none(), st.integers(1, 8192)),
            st.one_of(st.none(), st.sampled_from(("bert", "resnet50", "dqn"))),
            st.one_of(
                st.floats(1e-6, 1e8, allow_nan=False), st.integers(1, 10**7).map(lambda i: -i)
            ),
        ),
        max_size=30,
    ),
    st.integers(0, 2**32),
)
def test_materialized_jobs_always_have_gpus_batch_and_iterations_in_range(
    rows: list[tuple[int, int | None, str | None, float]], seed: int
) -> None:
    # a negative number stands for an iteration count, a positive one for a run time
    jobs = [
        TraceJob(
            f"j{i}",
            float(i),
            gpus,
            model,
            batch,
            duration_s=amount if amount > 0 else None,
            iterations=int(-amount) if amount < 0 else None,
        )
        for i, (gpus, batch, model, amount) in enumerate(rows)
    ]
    for spec in materialize(jobs, TinyPerf(), seed=seed):
        assert spec.gpus >= 1
        assert spec.batch_size >= spec.gpus
        assert 0 < spec.iterations < math.inf
