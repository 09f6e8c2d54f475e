"""Shared fixtures: a real nats-server with JetStream, one per test, on a free port."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from libs.common.bus import Stores, connection
from libs.common.embedded import NatsServer


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
