"""Small promises of the command line: `gpusched policies` tells every policy apart, the
README's example spec is one the API accepts, and `gpusched jobs` shows ids whole."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from aiohttp import web

from gpusched.libs.core.groundtruth import load_performance_model
from gpusched.services.admission.specs import decode_spec, total_iterations
from gpusched.services.scheduler.policies import POLICIES

ROOT = Path(__file__).resolve().parents[1]
GPUSCHED = [sys.executable, "-m", "gpusched.services.cli.main"]


async def run_cli(*args: str, columns: int) -> str:
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "dumb"}
    process = await asyncio.create_subprocess_exec(
        *GPUSCHED, *args, cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return out.decode()


async def test_gpusched_policies_gives_every_policy_a_line_of_its_own():
    output = await run_cli("policies", columns=400)
    lines = {}
    for line in output.splitlines()[1:]:  # the first line is the header
        name, _, description = line.strip().partition(" ")
        if name:
            lines[name] = description.strip()
    assert list(lines) == list(POLICIES)
    assert all(lines.values())
    assert len(set(lines.values())) == len(lines), lines
    # whole sentences, not a docstring's first line cut where it wrapped
    assert all(d.endswith((".", ")")) for d in lines.values()), lines


def test_the_example_job_spec_is_accepted_by_the_admission_decoder():
    body = (ROOT / "examples" / "job.yaml").read_bytes()
    spec = decode_spec(body, "application/yaml")
    models = load_performance_model(None).models()
    assert total_iterations(spec, models) == spec.iterations == 500
    assert (spec.name, spec.model, spec.gpus) == ("resnet50-demo", "resnet50", 2)


async def test_gpusched_jobs_shows_a_long_id_whole_on_a_narrow_terminal():
    job_id = "j018f2b3c4d5e" + "a" * 40  # longer than any column an 80-wide table gives
    listing = {"jobs": [{
        "id": job_id, "state": "PENDING", "total_iterations": 500,
        "spec": {"name": "a-long-job-name-that-wraps", "model": "resnet50", "gpus": 2},
        "pending_reason": "waiting for 2 idle GPUs behind 3 jobs ahead in the queue",
    }]}  # fmt: skip

    async def jobs(_: web.Request) -> web.Response:
        return web.json_response(listing)

    app = web.Application()
    app.router.add_get("/v1/jobs", jobs)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        output = await run_cli("jobs", "--url", f"http://127.0.0.1:{port}", "--token", "t",
                               columns=80)  # fmt: skip
    finally:
        await runner.cleanup()
    assert any(job_id in line for line in output.splitlines()), output
