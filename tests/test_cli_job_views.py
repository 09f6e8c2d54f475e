"""What `gpusched submit`, `jobs`, `job` and `tap` print for a person: the real CLI in a
subprocess (its output a pipe, as in `gpusched jobs | grep ...`) against the real
admission service on a real nats-server. Records are written where the scheduler would
write them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpusched.libs.common import codec
from gpusched.libs.common.bus import Stores
from gpusched.libs.common.embedded import NatsServer, wait_until
from gpusched.libs.common.schemas import (
    GpuInfo,
    JobRecord,
    JobState,
    NodeInfo,
    Placement,
    Progress,
    StateChange,
)
from gpusched.services.admission import AdmissionConfig, AdmissionService

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "tok-alpha"
#: 2027-01-15 08:00:00 UTC, 13:30:00 in Kolkata (UTC+05:30 all year)
T0 = 1_800_000_000.0


@pytest.fixture
async def service(nats_server: NatsServer) -> AsyncIterator[AdmissionService]:
    config = AdmissionConfig(nats_url=nats_server.url, port=0,
                             tokens={TOKEN: "alpha", "tok-empty": "nobody"})
    async with AdmissionService(config) as running:
        yield running


async def gpusched(
    service: AdmissionService | None, *args: str, token: str = TOKEN, **env: str
) -> tuple[int, str, str]:
    """The CLI in a subprocess (the service lives on this event loop), stdout a pipe."""
    environment = {**os.environ, "COLUMNS": "80", "TERM": "dumb", **env}
    if service is not None:
        environment.update(GPUSCHED_URL=service.url, GPUSCHED_TOKEN=token)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpusched.services.cli.main", *args, cwd=ROOT,
        env=environment, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate()
    return process.returncode or 0, out.decode(), err.decode()


async def submitted(service: AdmissionService, *flags: str) -> str:
    code, out, err = await gpusched(service, "submit", "--model", "resnet50",
                                    "--batch-size", "64", "--iterations", "500", *flags)
    assert code == 0, err
    return out.strip()


async def rewrite(stores: Stores, job_id: str, **changes: Any) -> None:
    """A compare-and-set update of the record, as the scheduler makes."""
    entry = await stores.jobs.get(job_id)
    assert entry.value is not None
    record = msgspec.structs.replace(codec.decode(entry.value, JobRecord), **changes)
    await stores.jobs.update(job_id, codec.encode(record), last=entry.revision)


# ---------------------------------------------------------------------- gpusched job


async def test_gpusched_job_shows_the_history_in_local_time_with_how_long_each_state_lasted(
    service: AdmissionService, stores: Stores
):
    job_id = await submitted(service, "--gpus", "2", "--name", "demo")
    await rewrite(
        stores, job_id, state=JobState.SUCCEEDED, submitted_at=T0,
        history=[StateChange(JobState.QUEUED, T0, "submitted"),
                 StateChange(JobState.RUNNING, T0 + 3, "started on node-0"),
                 StateChange(JobState.SUCCEEDED, T0 + 250, "finished")],
        placement=[Placement("node-0", [0, 1])],
        progress=Progress(iteration=500, samples_per_s=812.3, loss=0.41234, at=T0 + 249),
        exit_code=0,
    )  # fmt: skip

    code, out, err = await gpusched(service, "job", job_id, TZ="Asia/Kolkata")

    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["job", job_id, "demo"]
    assert "state      SUCCEEDED at 2027-01-15 13:34:10, 4 min 10 s after submission " \
           "(waited 3 s, ran 4 min 7 s)" in lines
    assert "shape      resnet50, batch 64 on 2 GPUs" in lines
    assert ("progress   500 / 500 iterations (100 %), loss 0.4123, 812 samples/s, "
            "reported 2027-01-15 13:34:09") in lines
    assert "placement  node-0 GPUs 0,1" in lines
    history = lines[lines.index("history (local time, IST, UTC+05:30):") + 1:]
    # columns: when, state, how long it lasted, why
    assert [re.split(r"\s{2,}", line.strip()) for line in history] == [
        ["2027-01-15 13:30:00", "QUEUED", "3 s", "submitted"],
        ["2027-01-15 13:30:03", "RUNNING", "4 min 7 s", "started on node-0"],
        ["2027-01-15 13:34:10", "SUCCEEDED", "finished"],
    ]
    assert "1800000" not in out  # no epoch seconds anywhere


async def test_gpusched_job_says_how_long_a_waiting_job_has_waited_and_why(
    service: AdmissionService, stores: Stores
):
    job_id = await submitted(service)
    reason = "unschedulable: needs 64 GPUs; the cluster has 8"
    await rewrite(stores, job_id, pending_reason=reason)

    code, out, err = await gpusched(service, "job", job_id)

    assert code == 0, err
    assert f"waiting    {reason}" in out.splitlines()
    state = next(line for line in out.splitlines() if line.startswith("state"))
    assert state.startswith("state      QUEUED for ") and "ran 0 s" in state
    assert "so far  submitted" in out


async def test_gpusched_job_json_prints_the_api_record_unchanged(
    service: AdmissionService, stores: Stores
):
    job_id = await submitted(service)

    code, out, err = await gpusched(service, "job", job_id, "--json")

    assert code == 0, err
    record = json.loads(out)
    assert record["id"] == job_id
    assert isinstance(record["submitted_at"], float)
    assert [h["state"] for h in record["history"]] == ["QUEUED"]


# ---------------------------------------------------------------------- gpusched jobs


async def test_gpusched_jobs_into_a_pipe_prints_each_job_whole_on_one_line(
    service: AdmissionService, stores: Stores
):
    first = await submitted(service, "--name", "a-long-job-name-that-would-wrap-at-eighty")
    second = await submitted(service, "--gpus", "2")
    reason = "waiting for 2 idle GPUs behind 3 jobs ahead in the queue; largest idle block 1"
    await rewrite(stores, first, pending_reason=reason)
    await rewrite(stores, second, state=JobState.RUNNING,
                  placement=[Placement("node-0", [0]), Placement("node-1", [3])],
                  progress=Progress(iteration=120))

    code, out, err = await gpusched(service, "jobs")

    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split()[:6] == ["ID", "NAME", "MODEL", "GPUS", "STATE", "PROGRESS"]
    assert len(rows) == 2
    assert rows[0].startswith(first) and rows[0].endswith(reason)
    assert "a-long-job-name-that-would-wrap-at-eighty" in rows[0]
    assert rows[1].startswith(second)
    assert rows[1].split()[4:] == ["RUNNING", "120/500", "node-0:0,", "node-1:3"]
    assert not any(ch in out for ch in "│┃━─")  # no box drawing in a pipe


async def test_gpusched_jobs_with_no_jobs_says_so_and_how_to_submit_one(
    service: AdmissionService,
):
    code, out, err = await gpusched(service, "jobs", token="tok-empty")

    assert code == 0, err
    assert out == ""
    assert "no jobs yet" in err and "gpusched submit" in err


async def test_gpusched_jobs_of_a_state_none_holds_names_the_state(service: AdmissionService):
    await submitted(service)

    code, out, err = await gpusched(service, "jobs", "--state", "running")

    assert code == 0, err
    assert out == ""
    assert "no RUNNING jobs" in err


# ---------------------------------------------------------------------- gpusched submit


async def test_submit_prints_the_id_and_warns_on_stderr_when_the_cluster_cannot_hold_it(
    service: AdmissionService, stores: Stores
):
    for name in ("node-a", "node-b"):
        info = NodeInfo(name=name, cpus=32, host_mem_gb=256, gpus=[
            GpuInfo(index=i, uuid=f"GPU-{name}-{i}", model="V100", memory_mb=32768)
            for i in range(4)])  # fmt: skip
        await stores.nodes.put(name, codec.encode(info))
    await wait_until(lambda: service_knows_nodes(service, 2), timeout_s=10)

    job_id = await submitted(service, "--gpus", "64")
    code, out, err = await gpusched(service, "submit", "--model", "resnet50", "--batch-size",
                                    "64", "--iterations", "5", "--gpus", "64")

    assert job_id.startswith("j") and len(job_id.split()) == 1
    assert code == 0
    assert out.strip().startswith("j") and "\n" not in out.strip()
    assert " ".join(err.split()) == (
        "warning: the cluster cannot hold 64 GPUs today: it has 8 in all, at most 4 on a "
        "node (2 nodes registered); the job waits until nodes join"
    )


def service_knows_nodes(service: AdmissionService, count: int) -> bool:
    from gpusched.services.admission.app import API

    assert service.app is not None
    return len(service.app[API].nodes.nodes()) == count


async def test_a_refused_field_is_named_once(service: AdmissionService):
    code, out, err = await gpusched(service, "submit", "--model", "resnet50",
                                    "--batch-size", "-1", "--iterations", "5")

    assert code == 2
    assert out == ""
    assert err.count("batch_size") == 1, err
    assert "error: batch_size: " in err


# ---------------------------------------------------------------------- gpusched tap


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_tap_without_a_cluster_says_so_in_one_line_without_debug_noise(tmp_path: Path):
    url = f"nats://127.0.0.1:{closed_port()}"

    code, out, err = await gpusched(None, "tap", "--nats-url", url,
                                    GPUSCHED_STATE_DIR=str(tmp_path))

    assert code == 1
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: cannot reach NATS at {url}")
    assert "gpusched up" in lines[0]


async def test_submit_flags_give_a_deadline_from_now_and_elastic_batch_bounds(
    service: AdmissionService, stores: Stores
):
    before = time.time()
    job_id = await submitted(
        service, "--deadline-in", "3600", "--min-batch-size", "32", "--max-batch-size", "256"
    )
    entry = await stores.jobs.get(job_id)
    assert entry.value is not None
    spec = codec.decode(entry.value, JobRecord).spec
    assert (spec.min_batch_size, spec.max_batch_size) == (32, 256)
    assert spec.deadline is not None and before + 3600 <= spec.deadline <= time.time() + 3600
    # a bound that leaves out the job's own batch is refused, naming the field
    code, out, err = await gpusched(service, "submit", "--model", "resnet50", "--batch-size",
                                    "64", "--iterations", "5", "--min-batch-size", "128")
    assert code == 2 and out == ""
    assert "min_batch_size" in err
