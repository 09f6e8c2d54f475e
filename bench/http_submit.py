"""Job submissions through the admission HTTP API: throughput and latency.

By default starts an embedded nats-server and an admission service in this process,
and runs the HTTP clients (32 concurrent connections) in a separate process, so the
load generator's work is not counted against the service's event loop. With --url and
--token it targets a running service (e.g. one started by ``gpusched up``) instead.

    python bench/http_submit.py [--jobs 5000 | --duration 10] [--concurrency 32]
                                [--url http://127.0.0.1:8080 --token TOKEN]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from speed import print_machine_speed  # bench/ is the script's own directory

from gpusched.libs.common import subjects
from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.embedded import NatsServer
from gpusched.libs.common.logging import configure_logging
from gpusched.services.admission import AdmissionConfig, AdmissionService

BENCH_TOKEN = "bench-token"
BODY = json.dumps(
    {"name": "bench", "model": "resnet50", "batch_size": 64, "iterations": 1000, "gpus": 1}
).encode()


@dataclass
class LoadResult:
    latencies_s: list[float]
    errors: dict[str, int]
    wall_s: float
    #: CPU seconds the load generator's process used while measuring
    client_cpu_s: float = 0.0


class _RawConnection:
    """One keep-alive HTTP/1.1 connection sending the same pre-built POST: a load
    generator that costs the machine a fraction of aiohttp's client per request, so that
    on a small machine more of it is left to the service measured."""

    def __init__(self, url: str, token: str | None) -> None:
        address = url.split("://", 1)[1].split("/", 1)[0]
        self.host, _, port = address.rpartition(":")
        self.port = int(port)
        lines = ["POST /v1/jobs HTTP/1.1", f"Host: {address}",
                 "Content-Type: application/json", f"Content-Length: {len(BODY)}"]
        if token:
            lines.append(f"Authorization: Bearer {token}")
        self.request = ("\r\n".join(lines) + "\r\n\r\n").encode() + BODY
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self) -> int:
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _load(url: str, token: str | None, jobs: int | None, duration_s: float | None,
                concurrency: int, warmup: int, client: str) -> LoadResult:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    latencies: list[float] = []
    errors: dict[str, int] = {}
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        endpoint = f"{url}/v1/jobs"

        async def aiohttp_post() -> int:
            async with session.post(endpoint, data=BODY) as response:
                await response.read()
                return response.status

        remaining = 0
        deadline: float | None = None

        async def worker() -> None:
            nonlocal remaining
            connection = _RawConnection(url, token) if client == "raw" else None
            post = connection.post if connection is not None else aiohttp_post
            try:
                while True:
                    if deadline is not None:
                        if time.perf_counter() >= deadline:
                            return
                    elif remaining <= 0:
                        return
                    remaining -= 1
                    started = time.perf_counter()
                    try:
                        status = await post()
                    except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as exc:
                        errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                        continue
                    latencies.append(time.perf_counter() - started)
                    if status != 201:
                        errors[str(status)] = errors.get(str(status), 0) + 1
            finally:
                if connection is not None:
                    connection.close()

        # connections opened and code paths warmed before measuring
        remaining = warmup
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        errors.clear()
        latencies.clear()
        remaining = jobs or 0
        deadline = time.perf_counter() + duration_s if duration_s else None
        started, cpu_started = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started
    return LoadResult(latencies, errors, wall_s, cpu_s)


def _client_process(arguments: dict[str, Any], results: Any) -> None:
    result = asyncio.run(_load(**arguments))
    results.put(result)


async def _run_clients(arguments: dict[str, Any]) -> LoadResult:
    """The load generator in its own process; this loop keeps serving meanwhile."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_client_process, args=(arguments, results), daemon=True)
    process.start()
    try:
        loop = asyncio.get_running_loop()
        result: LoadResult = await loop.run_in_executor(None, results.get)
    finally:
        await loop.run_in_executor(None, process.join)
    return result


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _report(result: LoadResult, where: str) -> None:
    latencies = sorted(result.latencies_s)
    count = len(latencies)
    if not count:
        print("no request completed", result.errors)
        return
    p50 = statistics.median(latencies) * 1000
    p99 = latencies[min(count - 1, int(count * 0.99))] * 1000
    errors = sum(result.errors.values())
    print(where)
    print(f"requests     {count} in {result.wall_s:.2f} s")
    print(f"submissions  {(count - errors) / result.wall_s:,.0f}/s")
    print(f"latency ms   p50 {p50:.2f}  p99 {p99:.2f}  max {latencies[-1] * 1000:.2f}")
    print(f"errors       {errors} {result.errors or ''}")
    print(f"client cpu   {result.client_cpu_s / count * 1e6:.0f} us/req")


async def _in_process(arguments: dict[str, Any]) -> None:
    with NatsServer() as server:
        config = AdmissionConfig(
            nats_url=server.url, port=0, tokens={BENCH_TOKEN: "bench"}
        )
        nats_pid = server._process.pid if server._process is not None else None
        async with AdmissionService(config) as service:
            cpu_before = os.times(), _cpu_s(nats_pid) if nats_pid else 0.0
            result = await _run_clients({**arguments, "url": service.url, "token": BENCH_TOKEN})
            cpu_after = os.times(), _cpu_s(nats_pid) if nats_pid else 0.0
            _report(
                result,
                "admission service and embedded nats-server in this process; "
                f"{arguments['concurrency']} HTTP clients in a separate process",
            )
            # CPU per request, less sensitive to other load on the machine than the rate;
            # the warm-up's requests are counted too
            requests = len(result.latencies_s) + arguments["warmup"]
            user = (cpu_after[0].user - cpu_before[0].user) / requests * 1e6
            system = (cpu_after[0].system - cpu_before[0].system) / requests * 1e6
            nats_us = (cpu_after[1] - cpu_before[1]) / requests * 1e6
            print(f"cpu us/req   admission {user + system:.0f} (user {user:.0f}, system "
                  f"{system:.0f})  nats-server {nats_us:.0f}")
            async with connection(server.url, "bench-check") as nc:
                stores = await Stores.open(nc)
                info = await stores.js.stream_info(subjects.JOBS_STREAM)
                print(f"stream       {info.state.messages} submissions stored (warm-up included)")


def main() -> None:
    print_machine_speed()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=5000, help="submissions to send")
    parser.add_argument("--duration", type=float, default=None,
                        help="send for this many seconds instead of a fixed count")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--url", default=None, help="a running admission service")
    parser.add_argument("--token", default=None, help="bearer token for --url")
    parser.add_argument("--client", choices=("aiohttp", "raw"), default="aiohttp",
                        help="the load generator: aiohttp's client, or raw keep-alive "
                        "HTTP/1.1 connections sending a pre-built request (less CPU)")
    parser.add_argument("--log-level", default="warning",
                        help="the in-process service's log level (info logs every job)")
    args = parser.parse_args()
    configure_logging(level=args.log_level, json=True)
    if args.jobs < 1 or args.concurrency < 1 or (args.duration is not None and args.duration <= 0):
        parser.error("--jobs, --concurrency and --duration must be positive")
    arguments = {
        "jobs": None if args.duration else args.jobs,
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "warmup": args.warmup,
        "client": args.client,
    }
    if args.url:
        result = asyncio.run(
            _run_clients({**arguments, "url": args.url.rstrip("/"), "token": args.token})
        )
        _report(result, f"{args.url}; {args.concurrency} HTTP clients in a separate process")
        return
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_in_process(arguments))


if __name__ == "__main__":
    main()
