"""Submit-to-RUNNING latency through the front door on an idle cluster.

Starts `gpusched up`'s LocalCluster in-process (embedded nats-server, admission,
scheduler, predictor, emulated nodes), then submits jobs one at a time over HTTP and
measures from sending the POST to the job's RUNNING state event. Jobs are short and the
cluster is large enough that each one finds idle GPUs.

    python bench/submit_to_running.py [--jobs 200] [--policy sjf-bsbf]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
from nats.aio.msg import Msg
from speed import print_machine_speed  # bench/ is the script's own directory

from gpusched.libs.common import codec, subjects
from gpusched.libs.common.bus import connection
from gpusched.libs.common.logging import configure_logging
from gpusched.libs.common.schemas import JobState, JobStateEvent
from gpusched.services.cli.up import LocalCluster, UpConfig


async def measure(jobs: int, policy: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as state:
        config = UpConfig(nodes=8, gpus_per_node=8, policy=policy, port=0,
                          state_dir=Path(state), time_scale=0.001)
        async with LocalCluster(config) as cluster, connection(cluster.nats_url, "bench") as nc:
            running: dict[str, asyncio.Future[float]] = {}

            async def state_seen(msg: Msg) -> None:
                event = codec.decode(msg.data, JobStateEvent)
                if event.state is not JobState.RUNNING:
                    return
                # the event may come before the POST's answer does
                fresh = asyncio.get_running_loop().create_future()
                waiter = running.setdefault(event.job_id, fresh)
                if not waiter.done():
                    waiter.set_result(time.perf_counter())

            await nc.subscribe(subjects.ALL_JOB_STATES, cb=state_seen)
            await asyncio.sleep(2)  # nodes register, the scheduler leads
            latencies: list[float] = []
            headers = {"Authorization": f"Bearer {cluster.token}"}
            loop = asyncio.get_running_loop()
            async with aiohttp.ClientSession(headers=headers) as session:
                for i in range(jobs):
                    body = {"name": f"lat-{i}", "model": "resnet18", "batch_size": 64,
                            "iterations": 20}
                    sent = time.perf_counter()
                    async with session.post(f"{cluster.url}/v1/jobs", json=body) as response:
                        job_id = (await response.json())["id"]
                    waiter = running.setdefault(job_id, loop.create_future())
                    latencies.append(await asyncio.wait_for(waiter, 10) - sent)
    latencies.sort()
    return {
        "jobs": jobs,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000,
        "max_ms": latencies[-1] * 1000,
    }


def main() -> None:
    print_machine_speed()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--policy", default="sjf-bsbf")
    args = parser.parse_args()
    configure_logging(level="error")
    figures = asyncio.run(measure(args.jobs, args.policy))
    print(json.dumps({k: round(v, 2) for k, v in figures.items()}, indent=2))


if __name__ == "__main__":
    main()
