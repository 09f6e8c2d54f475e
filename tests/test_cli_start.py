"""`gpusched decode` runs once per message under `nats sub --translate`, and `tap` is a
live view: the command line must start without the simulator's heavy imports. Checked on
the import graph, which does not depend on how busy the machine is (bench/cli_start.py
measures the time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

ROOT = Path(__file__).resolve().parents[1]

#: what neither decode nor tap may import on start: each takes from tenths of a second
#: (matplotlib, scipy, aiohttp) to seconds (torch) on a busy machine
HEAVY = (
    "matplotlib", "torch", "sklearn", "scipy", "aiohttp",
    "gpusched.services.scheduler.simulation.simulator",
)

RESOLVE = """
import json, sys
import click, typer.main
from gpusched.services.cli.main import app
group = typer.main.get_command(app)
command = group.get_command(click.Context(group), sys.argv[1])
assert command is not None, sys.argv[1]
print(json.dumps(sorted(sys.modules)))
"""


def loaded_modules(command: str) -> set[str]:
    """The modules a fresh interpreter holds after importing the CLI and resolving
    ``command`` (what `gpusched COMMAND` has loaded when the command starts)."""
    done = subprocess.run(
        [sys.executable, "-c", RESOLVE, command],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return set(json.loads(done.stdout))


@pytest.mark.parametrize("command", ["decode", "tap"])
def test_the_cli_resolves_a_live_command_without_importing_the_simulator_stack(command: str):
    modules = loaded_modules(command)
    assert "gpusched.services.cli.main" in modules
    loaded = sorted(
        m for m in modules for heavy in HEAVY if m == heavy or m.startswith(heavy + ".")
    )
    assert not loaded, loaded


def test_decode_prints_a_messagepack_payload_as_json():
    payload = {"job": "j0001", "state": "RUNNING", "gpus": [0, 1], "rate": 2.5}
    done = subprocess.run(
        [sys.executable, "-m", "gpusched.services.cli.main", "decode"],
        cwd=ROOT, input=msgspec.msgpack.encode(payload), capture_output=True, check=True,
    )  # fmt: skip
    assert json.loads(done.stdout) == payload


ENTRY_DECODE = """
import json, sys
sys.argv = ["gpusched", "decode"]
from gpusched.services.cli.entry import main
main()
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""


def test_the_gpusched_entry_decodes_without_loading_the_command_line_framework():
    payload = {"job": "j0002", "state": "QUEUED", "reason": "needs 2 GPUs"}
    done = subprocess.run(
        [sys.executable, "-c", ENTRY_DECODE],
        cwd=ROOT, input=msgspec.msgpack.encode(payload), capture_output=True, check=True,
    )  # fmt: skip
    assert json.loads(done.stdout) == payload
    modules = set(json.loads(done.stderr))
    assert not modules & {"typer", "click", "rich", "gpusched.services.cli.main", *HEAVY}


def test_decode_help_still_comes_from_the_full_command_line():
    gpusched = Path(sys.executable).with_name("gpusched")
    done = subprocess.run(
        [gpusched, "decode", "--help"], capture_output=True, text=True, check=True
    )
    assert "Usage: gpusched decode" in done.stdout
    assert "nats sub --translate" in done.stdout
