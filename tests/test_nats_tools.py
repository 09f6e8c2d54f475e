"""An operator's NATS tools against `gpusched up`: the `tap` user may discover the
services (`nats micro ls` and `nats micro stats` send `$SRV.PING`/`STATS` and read the
answers on `_INBOX.>`), but may not call an endpoint. A real nats-server and the real
services; the client is plain nats-py with its default inbox, as the NATS CLI would be."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import nats
import pytest

from gpusched.libs.common.embedded import wait_until
from gpusched.libs.common.natsauth import credentials_in
from gpusched.services.cli.up import LocalCluster, UpConfig

#: a reply or a refusal arrives in milliseconds; the limit is for a busy machine
ANSWER_WAIT_S = 60.0


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GPUSCHED_STATE_DIR", str(tmp_path / "state"))
    config = UpConfig(nodes=1, gpus_per_node=1, policy="fifo", port=0,
                      state_dir=tmp_path / "state", metrics_port=None)
    async with LocalCluster(config) as running:
        yield running


async def test_the_tap_user_discovers_and_reads_stats_of_every_service_but_calls_none(
    cluster: LocalCluster,
) -> None:
    up = json.loads((cluster.config.state_dir / "up.json").read_text())
    servers, user, secret = credentials_in(up["nats_url"])
    assert user == "tap"
    refusals: asyncio.Queue[str] = asyncio.Queue()

    async def on_error(exc: Exception) -> None:
        await refusals.put(str(exc))

    nc = await nats.connect(servers=servers, user=user, password=secret or "",
                            error_cb=on_error, allow_reconnect=False)
    try:
        names: set[str] = set()
        answers = await nc.subscribe(nc.new_inbox())

        async def pinged() -> bool:
            await nc.publish("$SRV.PING", b"", reply=answers.subject)
            try:
                while True:
                    message = await answers.next_msg(timeout=0.5)
                    names.add(json.loads(message.data)["name"])
            except nats.errors.TimeoutError:
                pass
            return {"gpusched-scheduler", "gpusched-predictor", "gpusched-nodeagent"} <= names

        await wait_until(pinged, timeout_s=ANSWER_WAIT_S, every_s=0.1)
        stats = await nc.request("$SRV.STATS.gpusched-nodeagent", b"", timeout=ANSWER_WAIT_S)
        assert json.loads(stats.data)["type"] == "io.nats.micro.v1.stats_response"
        # an endpoint is not the tap user's to call
        await nc.publish("gpusched.predictor.iterations", b"{}", reply=answers.subject)
        refusal = await asyncio.wait_for(refusals.get(), ANSWER_WAIT_S)
        assert "permissions violation" in refusal.lower()
        assert "gpusched.predictor.iterations" in refusal
    finally:
        await nc.close()
