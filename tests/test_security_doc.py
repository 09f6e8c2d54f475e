"""docs/security.md's table of NATS users says what each may publish and subscribe to;
the permissions the server enforces are built in libs/common/natsauth.py. Every gpusched
subject either one names, the other names too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpusched.libs.common import natsauth

DOC = Path(__file__).resolve().parents[1] / "docs" / "security.md"
NODE = "node-x"
USERS = {
    "admission": natsauth.admission(),
    "scheduler": natsauth.scheduler(),
    "predictor": natsauth.predictor(),
    "nodeagent-<node>": natsauth.nodeagent(NODE),
    "tap": natsauth.tap(),
}


def table_rows() -> dict[str, tuple[str, str]]:
    """user -> (publishes cell, subscribes cell) of the NATS users table."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            user = cells[0].split("`")[1]
            rows[user] = (cells[1], cells[2])
    return rows


def documented(cell: str) -> set[str]:
    """The gpusched subjects a cell names in backticks, with <node> for the node."""
    return {s for s in re.findall(r"`([^`]+)`", cell) if s.startswith("gpusched.")}


def enforced(subjects: tuple[str, ...]) -> set[str]:
    return {s.replace(NODE, "<node>") for s in subjects if s.startswith("gpusched.")}


def test_the_security_doc_has_a_row_for_every_nats_user():
    assert set(table_rows()) == set(USERS)


@pytest.mark.parametrize("user", sorted(USERS))
def test_the_security_doc_names_exactly_the_subjects_each_user_may_use(user: str):
    publishes, subscribes = table_rows()[user]
    permissions = USERS[user]
    assert documented(publishes) == enforced(permissions.publish), "publishes"
    assert documented(subscribes) == enforced(permissions.subscribe), "subscribes"
