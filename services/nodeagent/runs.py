"""What one run of a job is on a node: a simulated clock, or a supervised process.

A simulated run is a piecewise-linear function of wall time owned by the node's actor:
no task per iteration, just one timer for its finish, so hundreds of agents with several
jobs each fit in one process. A process run (the torch worker or a user's command) is
its own actor: it owns the child process, tails the progress file the child appends to,
keeps the run log and reports progress and its end to the node as messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Literal

import msgspec

from gpusched.libs.common.actor import Actor
from gpusched.libs.common.schemas import Progress, StopReason
from gpusched.services.nodeagent.cores import pin, pin_group
from gpusched.services.nodeagent.jobuser import JobUser, give_directory

Outcome = Literal["succeeded", "failed", "stopped"]

#: how much of a failed run's stderr goes into its JobExit
STDERR_TAIL_BYTES = 2048
#: after the main process exits, how long its stderr may take to reach end of file
STDERR_DRAIN_S = 1.0


@dataclass(frozen=True, slots=True)
class RunEnd:
    """How a run ended, before the node wraps it into a JobExit."""

    outcome: Outcome
    iteration: int
    exit_code: int | None = None
    stderr_tail: str = ""
    #: the last progress the run reported (None: it reported none)
    progress: Progress | None = None


# ---- simulated runs -----------------------------------------------------------------


class SimulatedProgress:
    """The iteration a simulated run has reached, at any wall time: it advances at
    ``wall_iteration_s`` per iteration from ``settled_at``, until ``total``."""

    __slots__ = ("iteration", "settled_at", "total", "wall_iteration_s")

    def __init__(self, start: int, total: int, wall_iteration_s: float, now: float) -> None:
        self.total = total
        self.iteration = float(min(start, total))
        self.settled_at = now
        self.wall_iteration_s = wall_iteration_s

    def at(self, now: float) -> float:
        elapsed = max(0.0, now - self.settled_at)
        return min(float(self.total), self.iteration + elapsed / self.wall_iteration_s)

    def change_speed(self, wall_iteration_s: float, now: float) -> None:
        self.iteration = self.at(now)
        self.settled_at = now
        self.wall_iteration_s = wall_iteration_s

    def finishes_at(self) -> float:
        return self.settled_at + (self.total - self.iteration) * self.wall_iteration_s


# ---- the progress file --------------------------------------------------------------


class ProgressLine(msgspec.Struct, frozen=True):
    """One JSON line a worker appends to its progress file."""

    event: Literal["progress", "checkpoint", "done"]
    iteration: int
    samples_per_s: float = 0.0
    loss: float | None = None
    gpu_mem_mb: float = 0.0
    at: float | None = None
    #: the built-in worker's metrics (None where a worker does not report them)
    epoch: float | None = None
    accuracy: float | None = None
    lr: float | None = None


_line_decoder = msgspec.json.Decoder(ProgressLine)


class ProgressTail:
    """Reads the lines appended to a file since the last read; a line still being
    written (no newline yet) waits for the next read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.bad_lines = 0
        self.last_error = ""

    def read(self) -> list[ProgressLine]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *complete, self._partial = (self._partial + chunk).split(b"\n")
        lines = []
        for raw in complete:
            if not raw.strip():
                continue
            try:
                lines.append(_line_decoder.decode(raw))
            except msgspec.DecodeError as exc:
                self.bad_lines += 1
                self.last_error = f"{exc}: {raw[:200]!r}"
        return lines


# ---- process runs -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessPlan:
    """Everything needed to start and judge one process run."""

    node: str
    job_id: str
    run_id: int
    argv: tuple[str, ...]
    env: dict[str, str]
    progress_file: Path
    log_file: Path
    checkpoint_dir: Path
    total_iterations: int
    start_iteration: int
    kill_grace_s: float
    preempt_grace_s: float
    poll_s: float
    #: the machine's cores the process is pinned to (empty: not pinned), its host memory
    #: (GB) and the file telling the process both (rewritten on a reallocation)
    cores: tuple[int, ...] = ()
    mem_gb: float | None = None
    allocation_file: Path | None = None
    #: the user the process runs as (None: the agent's own) and its working directory,
    #: its own (services/nodeagent/jobuser.py)
    user: JobUser | None = None
    job_dir: Path | None = None


@dataclass(frozen=True, slots=True)
class ProcessStarted:
    job_id: str
    run_id: int
    pid: int


@dataclass(frozen=True, slots=True)
class ProcessProgress:
    job_id: str
    run_id: int
    progress: Progress
    #: (iteration, seconds since the epoch) of each progress line read, oldest first
    samples: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class RunEnded:
    job_id: str
    run_id: int
    end: RunEnd


ReportMessage = ProcessStarted | ProcessProgress | RunEnded


@dataclass(frozen=True, slots=True)
class StopRun:
    reason: StopReason


@dataclass(frozen=True, slots=True)
class ReallocateRun:
    """Re-pin the running process to ``cores`` and tell it its new memory bound."""

    cores: tuple[int, ...]
    mem_gb: float | None


@dataclass(frozen=True, slots=True)
class _Poll:
    pass


@dataclass(frozen=True, slots=True)
class _Exited:
    returncode: int


@dataclass(frozen=True, slots=True)
class _Kill:
    pass


RunMessage = StopRun | ReallocateRun | _Poll | _Exited | _Kill


class ProcessRun(Actor[RunMessage]):
    """One child process and its files. Reports ``ProcessStarted``, ``ProcessProgress``
    and exactly one ``RunEnded`` through ``report``."""

    name = "nodeagent.run"

    def __init__(self, plan: ProcessPlan, report: Callable[[ReportMessage], None]) -> None:
        super().__init__()
        self.plan = plan
        self._report = report
        self.log = self.log.bind(node=plan.node, job_id=plan.job_id, run_id=plan.run_id)
        self._process: asyncio.subprocess.Process | None = None
        self._log_handle: IO[bytes] | None = None
        self._stderr_tail = b""
        self._tail = ProgressTail(plan.progress_file)
        self._saw_progress = False
        self._done = False
        self._latest = Progress(iteration=plan.start_iteration)
        self._checkpoint = plan.start_iteration
        self._stop_reason: StopReason | None = None
        self._kill_timer: asyncio.TimerHandle | None = None
        self._kill_deadline = float("inf")
        self._ended = False
        self._cores = plan.cores
        self._mem_gb = plan.mem_gb

    # ---- lifecycle --------------------------------------------------------------
    async def on_start(self) -> None:
        plan = self.plan
        try:
            if plan.user is not None and plan.job_dir is not None:
                give_directory(plan.job_dir, plan.user)
            plan.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            if plan.user is not None:
                os.chown(plan.checkpoint_dir, plan.user.uid, plan.user.gid)
            plan.progress_file.unlink(missing_ok=True)
            self._log_handle = plan.log_file.open("ab")
            self._write_allocation()
            self._process = await asyncio.create_subprocess_exec(
                *plan.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=self._log_handle,
                stderr=asyncio.subprocess.PIPE,
                env=plan.env,
                cwd=plan.job_dir,
                # its own process group: signals reach its children too, and a Ctrl-C
                # meant for the agent does not reach the job
                start_new_session=True,
                **as_user(plan.user),
            )
        except Exception as exc:
            # whatever keeps the process from starting (a missing program, no permission,
            # a NUL byte in an argument or the environment, a full disk) ends the run as
            # failed, saying why: the job never holds its GPUs without a process
            self.log.warning("process not started", argv0=plan.argv[0][:256], error=repr(exc))
            self._end(RunEnd("failed", plan.start_iteration, None,
                             f"cannot start {plan.argv[0]!r}: {_reason(exc)}"))
            return
        if self._cores:
            # right after the exec, before the job starts threads or children: they
            # inherit it (a reallocation before this point is already in self._cores)
            try:
                pin(self._process.pid, self._cores)
            except OSError as exc:  # the process runs all the same, on any core
                self.log.warning("could not pin the process", cores=list(self._cores),
                                 error=repr(exc))
        self._report(ProcessStarted(plan.job_id, plan.run_id, self._process.pid))
        self.spawn(self._watch(self._process))
        self.every(plan.poll_s, _Poll)

    async def on_stop(self) -> None:
        if self._kill_timer is not None:
            self._kill_timer.cancel()
        if self._process is not None and self._process.returncode is None:
            # stopped before its process ended (the agent gave up waiting): leave no orphan
            self.log.warning("killing a run left behind", pid=self._process.pid)
            self._signal(signal.SIGKILL)
        if self._log_handle is not None:
            self._log_handle.close()

    async def handle(self, message: RunMessage) -> None:
        match message:
            case _Poll():
                self._poll()
            case StopRun(reason):
                self._stop(reason)
            case ReallocateRun(cores, mem_gb):
                self._reallocate(cores, mem_gb)
            case _Kill():
                self._signal(signal.SIGKILL)
            case _Exited(returncode):
                self._poll()
                self._end(self._judge(returncode))

    # ---- the child ----------------------------------------------------------------
    async def _watch(self, process: asyncio.subprocess.Process) -> None:
        reader = asyncio.ensure_future(self._read_stderr(process))
        try:
            returncode = await process.wait()
            # leftovers of the job (its own children) must not hold GPUs after it
            self._signal(signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(reader), STDERR_DRAIN_S)
        finally:
            reader.cancel()
        self.tell(_Exited(returncode))

    async def _read_stderr(self, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        while chunk := await process.stderr.read(65536):
            if self._log_handle is not None:
                self._log_handle.write(chunk)
                self._log_handle.flush()
            self._stderr_tail = (self._stderr_tail + chunk)[-2 * STDERR_TAIL_BYTES:]

    def _signal(self, number: signal.Signals) -> None:
        if self._process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, number)

    def _stop(self, reason: StopReason) -> None:
        if self._ended or self._process is None:
            return
        if self._stop_reason is None:
            self._stop_reason = reason
            self.log.info("stopping run", reason=reason, pid=self._process.pid)
            self._signal(signal.SIGTERM)
        grace = self.plan.preempt_grace_s if reason == "preempt" else self.plan.kill_grace_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        if deadline < self._kill_deadline:
            # a cancel after a preemption shortens the wait, never the other way round
            if self._kill_timer is not None:
                self._kill_timer.cancel()
            self._kill_deadline = deadline
            self._kill_timer = loop.call_at(deadline, self.tell, _Kill())

    # ---- CPU and memory allocation ---------------------------------------------------
    def _write_allocation(self) -> None:
        path = self.plan.allocation_file
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_bytes(
            msgspec.json.encode({"cpus": list(self._cores), "mem_gb": self._mem_gb})
        )
        os.replace(temporary, path)  # the process never reads half a file

    def _reallocate(self, cores: tuple[int, ...], mem_gb: float | None) -> None:
        self._cores, self._mem_gb = cores, mem_gb
        with contextlib.suppress(OSError):
            self._write_allocation()
        process = self._process
        if cores and process is not None and process.returncode is None:
            # the whole group: data-loader workers and local ranks are its children
            pin_group(process.pid, cores)
        self.log.info("reallocated", cores=list(cores), mem_gb=mem_gb)

    # ---- progress and the verdict -------------------------------------------------
    def _poll(self) -> None:
        lines = self._tail.read()
        if not lines:
            return
        received = time.time()
        samples = []
        for line in lines:
            at = received if line.at is None else line.at
            self._saw_progress = True
            last = self._latest
            # a line without a metric (a "done" line often has none) keeps the last one
            self._latest = Progress(
                iteration=line.iteration,
                samples_per_s=line.samples_per_s or last.samples_per_s,
                loss=last.loss if line.loss is None else line.loss,
                gpu_mem_mb=line.gpu_mem_mb or last.gpu_mem_mb,
                at=at,
                epoch=last.epoch if line.epoch is None else line.epoch,
                accuracy=last.accuracy if line.accuracy is None else line.accuracy,
                lr=last.lr if line.lr is None else line.lr,
            )
            if line.event == "checkpoint":
                self._checkpoint = max(self._checkpoint, line.iteration)
            elif line.event == "done":
                self._done = True
            samples.append((line.iteration, at))
        if self._tail.bad_lines:
            self.log.warning(
                "unreadable progress lines", count=self._tail.bad_lines, last=self._tail.last_error
            )
            self._tail.bad_lines = 0
        self._report(
            ProcessProgress(self.plan.job_id, self.plan.run_id, self._latest, tuple(samples))
        )

    def stderr_tail(self) -> str:
        text = self._stderr_tail[-STDERR_TAIL_BYTES:].decode("utf-8", "replace")
        return text.lstrip("\ufffd")

    def _judge(self, returncode: int) -> RunEnd:
        plan = self.plan
        finished = self._done or self._latest.iteration >= plan.total_iterations
        if returncode == 0 and finished:
            # a done line before the total (the job ended early, e.g. converged) tells
            # how many iterations it ran
            ran = self._latest.iteration
            early = self._done and 0 < ran < plan.total_iterations
            return RunEnd("succeeded", ran if early else plan.total_iterations, 0)
        if self._stop_reason is not None:
            return RunEnd("stopped", self._checkpoint, returncode, self.stderr_tail())
        if returncode == 0 and not self._saw_progress:
            # a command that ignores the progress contract: its exit code is all we know
            return RunEnd("succeeded", plan.total_iterations, 0)
        tail = self.stderr_tail()
        if returncode == 0:
            tail += (
                f"\n[gpusched] exited with code 0 after {self._latest.iteration} of "
                f"{plan.total_iterations} iterations without being asked to stop"
            )
        return RunEnd("failed", self._checkpoint, returncode, tail)

    def _end(self, end: RunEnd) -> None:
        if self._ended:
            return
        self._ended = True
        if end.progress is None and self._saw_progress:
            end = replace(end, progress=self._latest)
        self._report(RunEnded(self.plan.job_id, self.plan.run_id, end))


def _reason(exc: Exception) -> str:
    """Why a process did not start, in one line: ``[Errno 2] No such file or directory:
    'train'`` for an OSError, ``ValueError: embedded null byte`` for anything else."""
    if isinstance(exc, OSError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


#: variables of the agent's environment a job process inherits; nothing else passes
#: (no NATS credentials, no API tokens, no agent settings)
INHERITED_VARIABLES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH",
    "NVIDIA_DRIVER_CAPABILITIES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_HOME",
})
#: prefixes of inherited variables: locale, NCCL tuning, the built-in worker's own knobs
INHERITED_PREFIXES = ("LC_", "NCCL_", "GPUSCHED_WORKER_")
#: the agent's variable naming further variables to pass on (comma-separated)
PASSTHROUGH_VARIABLE = "GPUSCHED_JOB_ENV_PASSTHROUGH"
#: never passed on, even when named in PASSTHROUGH_VARIABLE
WITHHELD_PREFIXES = ("NATS_",)


def inherited(name: str, extra: frozenset[str] = frozenset()) -> bool:
    if name.startswith(WITHHELD_PREFIXES):
        return False
    return name in INHERITED_VARIABLES or name in extra or name.startswith(INHERITED_PREFIXES)


def as_user(user: JobUser | None) -> dict[str, Any]:
    """The process options that run a child as ``user`` (nothing for the agent's own),
    with no supplementary group of the agent's."""
    if user is None:
        return {}
    return {"user": user.uid, "group": user.gid, "extra_groups": []}


def run_environment(
    values: dict[str, Any], base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The child's environment: the job contract, plus the few variables of the agent's
    own environment (``base``) that ``inherited`` allows. Everything else the agent holds
    (its NATS credentials, tokens, settings) stays out of the job."""
    source = os.environ if base is None else base
    extra = frozenset(
        n.strip() for n in source.get(PASSTHROUGH_VARIABLE, "").split(",") if n.strip()
    )
    env = {name: value for name, value in source.items() if inherited(name, extra)}
    env.update({key: str(value) for key, value in values.items()})
    return env
