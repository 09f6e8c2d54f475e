"""The example script of docs/sdk.md runs as a gpusched job and honours the contract."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from gpusched.libs.common.embedded import wait_until
from gpusched.libs.sdk import ENV_VARIABLES
from tests.limits import process_limit_s

REPOSITORY = Path(__file__).resolve().parents[1]


def documented_example() -> str:
    text = (REPOSITORY / "docs" / "sdk.md").read_text()
    section = text.split("### Example", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "docs/sdk.md has no python block under 'Example'"
    return match.group(1)


async def test_the_documented_example_runs_to_completion_as_a_job(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(documented_example())
    env = {key: value for key, value in os.environ.items() if key not in ENV_VARIABLES}
    env.update(
        PYTHONPATH=str(REPOSITORY),
        GPUSCHED_JOB_ID="example",
        GPUSCHED_RUN_ID="0",
        GPUSCHED_MODEL="mlp",
        GPUSCHED_BATCH_SIZE="8",
        GPUSCHED_ACCUM_STEPS="2",
        GPUSCHED_DEVICE="cpu",
        GPUSCHED_TOTAL_ITERATIONS="7",
        GPUSCHED_CHECKPOINT_DIR=str(tmp_path / "checkpoints"),
        GPUSCHED_CHECKPOINT_EVERY="3",
        GPUSCHED_PROGRESS_FILE=str(tmp_path / "progress.jsonl"),
    )
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen([sys.executable, str(script)], env=env, stderr=stderr)
    try:
        await wait_until(lambda: process.poll() is not None, timeout_s=process_limit_s(1))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    assert process.returncode == 0, stderr_path.read_text()
    lines = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [line["iteration"] for line in lines if line["event"] == "checkpoint"] == [3, 6, 7]
    assert (lines[-1]["event"], lines[-1]["iteration"]) == ("done", 7)
    assert (tmp_path / "checkpoints" / "checkpoint.pt").exists()
