"""Shared fixtures: a real nats-server with JetStream, one per test, on a free port."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from nats.aio.client import Client

from gpusched.libs.common.bus import Stores, connection
from gpusched.libs.common.embedded import NatsServer

# no example may fail for taking long: the suite runs on busy 2-core machines too. The
# examples are the same on every run (derandomize), so the suite passes or fails alike
# everywhere; GPUSCHED_HYPOTHESIS_EXPLORE=1 draws new ones to look for more
settings.register_profile(
    "gpusched",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=not os.environ.get("GPUSCHED_HYPOTHESIS_EXPLORE"),
)
settings.load_profile("gpusched")


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    with NatsServer(store_dir=tmp_path / "nats") as server:
        yield server


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    async with connection(nats_server.url, "test-client") as client:
        yield client


@pytest.fixture
async def stores(nc: Client) -> Stores:
    return await Stores.open(nc)
