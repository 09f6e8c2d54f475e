"""One process per GPU for a job's own command
(``python -m gpusched.services.nodeagent.worker.launch COMMAND...``).

The node agent runs a command given several GPUs on a node through this launcher, which
starts the command once per GPU, as the built-in worker starts one rank per GPU: the
process of local rank ``i`` gets ``LOCAL_RANK=i`` and ``RANK=<first rank> + i`` on top of
the job's environment (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE`` and the ``GPUSCHED_*`` contract), so an unmodified
``torch.distributed`` script with ``init_process_group(init_method="env://")`` finds its
peers. Only global rank 0 keeps ``GPUSCHED_PROGRESS_FILE``; the others report to
``os.devnull``.

All processes share the launcher's process group, so the agent's SIGTERM reaches each of
them; the launcher itself ignores it and waits for them. When one exits non-zero the
others are killed (they would wait for it in a collective) and the launcher exits with
its code; when all exit 0, so does the launcher. A process killed by a signal counts as
``128 + signal``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from gpusched.libs.sdk.context import PROGRESS_FILE

USAGE_ERROR = 2
#: how often the launcher looks at its processes
POLL_S = 0.05


def rank_environment(environ: Mapping[str, str], local_rank: int) -> dict[str, str]:
    """The environment of the process of ``local_rank`` on this node."""
    first = int(environ.get("RANK", "0") or 0)
    env = {**environ, "LOCAL_RANK": str(local_rank), "RANK": str(first + local_rank)}
    if first + local_rank > 0 and PROGRESS_FILE in env:
        env[PROGRESS_FILE] = os.devnull
    return env


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def launch(command: Sequence[str], environ: Mapping[str, str]) -> int:
    local_ranks = int(environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for local_rank in range(local_ranks):
            processes.append(
                subprocess.Popen(list(command), env=rank_environment(environ, local_rank))
            )
    except OSError as error:
        for process in processes:
            process.kill()
        print(f"gpusched launch: error: cannot start {command[0]!r}: {error}", file=sys.stderr)
        return 127
    running = list(processes)
    while running:
        for process in list(running):
            code = process.poll()
            if code is None:
                continue
            running.remove(process)
            if code != 0:
                for other in running:
                    other.kill()
                for other in running:
                    other.wait()
                return _exit_code(code)
        if running:
            time.sleep(POLL_S)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("gpusched launch: error: COMMAND: required", file=sys.stderr)
        return USAGE_ERROR
    # the agent signals the whole process group: the ranks checkpoint and exit, and the
    # launcher reports how they ended. A handler, not SIG_IGN: an ignored signal would
    # stay ignored in the processes it starts, a handler is reset by their exec
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, _wait_for_the_ranks)
    return launch(command, os.environ)


def _wait_for_the_ranks(number: int, frame: object) -> None:
    """The ranks got the same signal; the launcher waits for them to end."""


if __name__ == "__main__":
    sys.exit(main())
