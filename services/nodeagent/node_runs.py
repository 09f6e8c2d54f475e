"""The runs of one node, and the commands of the scheduler that change them.

:class:`NodeRuns` holds the node's runs (``residents.Run``) for the node agent's actor
and carries out what the actor is asked: a start (a simulated clock, or a supervised
process on the cores picked here), a stop, a resize (checkpoint, then restart with the
new shape) and a reallocation of CPU cores and host memory. Every run ends in
:meth:`NodeRuns.end`: a leader's exit goes to the exit outbox, or a resized run's
successor starts from where it checkpointed. It remembers the runs that ended, so that a
retried command does not rerun one. Only the actor calls it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

from gpusched.libs.common.embedded import free_port
from gpusched.libs.common.schemas import (
    CommandReply,
    Progress,
    ReallocateJob,
    ResizeJob,
    StartJob,
    StopJob,
    StopReason,
)
from gpusched.services.nodeagent.checks import run_kind, start_problem
from gpusched.services.nodeagent.config import NodeAgentConfig
from gpusched.services.nodeagent.cores import pick_cores, real_cores
from gpusched.services.nodeagent.exits import ExitOutbox, job_exit
from gpusched.services.nodeagent.gpu_profiling import GpuProfiling
from gpusched.services.nodeagent.gpus import GpuInventory
from gpusched.services.nodeagent.job_contract import process_plan
from gpusched.services.nodeagent.jobuser import JobUser, resolve_job_user
from gpusched.services.nodeagent.metrics import Metrics, NodeView
from gpusched.services.nodeagent.reporting import Reporter
from gpusched.services.nodeagent.residents import Run, RunKind, co_runners, cores_taken
from gpusched.services.nodeagent.resize import answer_without_resizing, resize_problem, resized
from gpusched.services.nodeagent.runs import (
    ProcessRun,
    ReallocateRun,
    ReportMessage,
    RunEnd,
    StopRun,
)
from gpusched.services.nodeagent.simulation import SimulatedClocks

#: (job, run) pairs remembered after they end, so that a retried start does not rerun them
REMEMBERED_RUNS = 4096


class NodeRuns:
    """The runs on one node, started, stopped, resized and reallocated for its actor."""

    def __init__(
        self,
        config: NodeAgentConfig,
        log: Any,
        metrics: Metrics,
        view: NodeView,
        inventory: GpuInventory,
        known_models: frozenset[str],
        machine_cores: tuple[int, ...],
        clocks: SimulatedClocks,
        reporter: Reporter,
        outbox: ExitOutbox,
        tell: Callable[[ReportMessage], None],
    ) -> None:
        self.config = config
        self.log = log
        self._metrics = metrics
        #: the agent's Prometheus series, which forget a job when its run ends
        self._view = view
        self._inventory = inventory
        self._known_models = known_models
        #: the machine's cores the node's (possibly emulated) cores map onto
        self._machine_cores = machine_cores
        self._clocks = clocks
        self._reporter = reporter
        self._outbox = outbox
        #: where a process run reports (the actor's inbox)
        self._tell = tell
        #: job id -> its run on this node
        self.runs: dict[str, Run] = {}
        self.ended: OrderedDict[tuple[str, int], None] = OrderedDict()
        #: set once the agent stops everything: no start, resize or restart is taken
        self.closing = False
        self._stopped_all: asyncio.Future[None] | None = None
        #: who job processes run as (None: the agent's own user; jobuser.py)
        self._job_user: JobUser | None = None
        self._job_user_known = False
        #: the measured profile of the node's GPU type (set once the agent serves it)
        self.gpu_profiling: GpuProfiling | None = None

    async def start(self, start: StartJob) -> CommandReply:
        current = self.runs.get(start.job_id)
        if current is not None:
            if current.run_id == start.run_id:
                # a retried command: it runs already
                return CommandReply(True, rendezvous=current.start.rendezvous)
            return CommandReply(
                False,
                f"job {start.job_id} already runs on {self.config.name} as run "
                f"{current.run_id}; stop that run first",
            )
        if (start.job_id, start.run_id) in self.ended:
            return CommandReply(True)  # it ran to its end already; its exit is reported
        if self.closing:
            return CommandReply(False, f"node agent {self.config.name} is shutting down")
        problem = self._start_problem(start)
        if problem:
            self.log.warning("start refused", job_id=start.job_id, error=problem)
            return CommandReply(False, problem)
        kind, problem = self._run_kind(start)
        if kind is None:
            self.log.warning("start refused", job_id=start.job_id, error=problem)
            return CommandReply(False, problem)
        if kind == "process" and start.leader and start.nodes > 1:
            # the other parts' ranks meet at this node; the reply tells the scheduler where
            start = msgspec.structs.replace(
                start,
                # other nodes connect: free on every interface
                rendezvous=f"tcp://{self.config.advertise_host}:{free_port('')}",
                first_rank=0,
                world_size=start.spec.gpus,
            )
        run = Run(
            start=start,
            kind=kind,
            log=self.log.bind(job_id=start.job_id, run_id=start.run_id),
            progress=Progress(iteration=start.resume_iteration if kind == "process" else 0),
        )
        if kind == "simulated":
            error = self._clocks.prepare(run)
            if error:
                return CommandReply(False, error)
        self.runs[start.job_id] = run
        if start.cpus is not None:
            run.cores = pick_cores(
                start.cpus, cores_taken(self.runs.values(), start.job_id), self.config.cpus
            )
        run.mem_gb = start.mem_gb
        self._metrics.runs_started.labels(kind).inc()
        self._metrics.running.inc()
        self._clocks.retime(self.runs.values(), start.gpus)
        run.log.info(
            "run started",
            kind=kind,
            model=start.spec.model,
            gpus=start.gpus,
            accum_steps=start.accum_steps,
            co_runners=co_runners(run, self.runs.values()),
            scheduler_co_runners=start.co_runners,
            resume_iteration=start.resume_iteration,
            total_iterations=start.total_iterations,
            leader=start.leader,
            nodes=start.nodes,
            **({"cores": run.cores} if run.cores else {}),
            **({"mem_gb": run.mem_gb} if run.mem_gb is not None else {}),
            **({"iteration_s": run.alone_s * run.slowdown} if kind == "simulated" else {}),
        )
        self._reporter.warn_if_memory_overflows(self.runs.values(), start.gpus)
        if kind == "process":
            try:
                if not self._job_user_known:
                    # resolved (and a system user created) when a process first runs
                    self._job_user, _ = await asyncio.to_thread(
                        resolve_job_user, self.config.job_user
                    )
                    self._job_user_known = True
                plan = process_plan(
                    start, self.config, self._inventory, self._real_cores(run.cores),
                    self._job_user,
                )
            except Exception as exc:  # no process to start: the run fails, saying why
                why = f"cannot prepare the job's process: {exc!r}"
                await self.end(run, RunEnd("failed", start.resume_iteration, None, why))
                return CommandReply(True, rendezvous=start.rendezvous)
            run.process = ProcessRun(plan, self._tell)
            await run.process.__aenter__()
        if self.config.measure_profiles and self.gpu_profiling is not None:
            self.gpu_profiling.on_start(start, kind)  # in the background
        return CommandReply(True, rendezvous=start.rendezvous)

    def _start_problem(self, start: StartJob) -> str:
        return start_problem(start, self._inventory, self.config.name)

    def _run_kind(self, start: StartJob) -> tuple[RunKind | None, str]:
        return run_kind(start, self._known_models, self.config.jobs_mode)

    def _real_cores(self, cores: tuple[int, ...]) -> tuple[int, ...]:
        return real_cores(cores, self._machine_cores) if cores else ()

    # ---- CPU and memory -----------------------------------------------------------------
    def reallocate(self, command: ReallocateJob) -> CommandReply:
        """Give a running run other CPU cores and host memory, without restarting it."""
        run = self.runs.get(command.job_id)
        if run is None or run.run_id != command.run_id:
            if (command.job_id, command.run_id) in self.ended:
                return CommandReply(True)  # it ended meanwhile: nothing left to change
            return CommandReply(
                False,
                f"run_id: job {command.job_id} does not run on {self.config.name} as run "
                f"{command.run_id}",
            )
        run.cores = pick_cores(
            command.cpus, cores_taken(self.runs.values(), run.job_id), self.config.cpus
        )
        run.mem_gb = command.mem_gb
        allocation = {"cpus": command.cpus, "mem_gb": command.mem_gb}
        # a later restart (a resize) keeps the allocation
        run.start = msgspec.structs.replace(run.start, **allocation)
        if run.successor is not None:
            run.successor = msgspec.structs.replace(run.successor, **allocation)
        if run.process is not None:
            run.process.tell(ReallocateRun(self._real_cores(run.cores), run.mem_gb))
        run.log.info("reallocated", cpus=command.cpus, cores=run.cores, mem_gb=run.mem_gb)
        return CommandReply(True)

    # ---- resizing -----------------------------------------------------------------------
    async def resize(self, resize: ResizeJob) -> CommandReply:
        """Checkpoint the current run, then restart it with the new shape (in :meth:`end`)."""
        run = self.runs.get(resize.job_id)
        answer = answer_without_resizing(
            resize, run, self.ended, self.config.name, self.closing
        )
        if answer is not None:
            return answer
        assert run is not None  # a resize of a run not here is answered above
        problem = resize_problem(run.start, resize)
        successor = resized(run.start, resize, self._known_models)
        problem = problem or self._start_problem(successor) or (self._run_kind(successor)[1])
        if problem:
            run.log.warning("resize refused", error=problem)
            return CommandReply(False, problem)
        run.successor = successor
        run.log.info(
            "resize requested",
            new_run_id=resize.new_run_id,
            batch_size=resize.batch_size,
            gpus=resize.gpus,
            accum_steps=resize.accum_steps,
        )
        await self._stop_run(run, "preempt")
        return CommandReply(True)

    # ---- stopping and ending ------------------------------------------------------------
    async def stop(self, stop: StopJob) -> CommandReply:
        run = self.runs.get(stop.job_id)
        if run is None or run.run_id != stop.run_id:
            return CommandReply(True)  # nothing of that run here: stopped already
        await self._stop_run(run, stop.reason)
        return CommandReply(True)

    async def _stop_run(self, run: Run, reason: StopReason) -> None:
        if run.stopping is None:
            run.log.info("stop requested", reason=reason)
        run.stopping = run.stopping or reason
        if run.process is not None:
            run.process.tell(StopRun(reason))
        elif run.clock is not None:
            # a simulated job checkpoints instantly: where it is now is where it resumes
            now = asyncio.get_running_loop().time()
            reached = int(run.clock.at(now))
            total = run.start.total_iterations
            end = RunEnd("succeeded", total, 0) if reached >= total else RunEnd(
                "stopped", reached, 0
            )
            await self.end(run, end)
        else:
            await self.end(run, RunEnd("stopped", 0))

    async def stop_all(self, reason: StopReason, done: asyncio.Future[None]) -> None:
        self.closing = True
        self._stopped_all = done
        for run in list(self.runs.values()):
            await self._stop_run(run, reason)
        self._resolve_stopped_all()

    def _resolve_stopped_all(self) -> None:
        if self._stopped_all is not None and not self.runs and not self._stopped_all.done():
            self._stopped_all.set_result(None)

    async def end(self, run: Run, end: RunEnd) -> None:
        if self.runs.get(run.job_id) is not run:
            return
        del self.runs[run.job_id]
        if run.finish_timer is not None:
            run.finish_timer.cancel()
        self.ended[(run.job_id, run.run_id)] = None
        while len(self.ended) > REMEMBERED_RUNS:
            self.ended.popitem(last=False)
        self._metrics.running.dec()
        self._metrics.runs_ended.labels(end.outcome).inc()
        self._view.forget_job(run.job_id)
        run.log.info(
            "run ended",
            outcome=end.outcome,
            iteration=end.iteration,
            exit_code=end.exit_code,
            **({"stderr_tail": end.stderr_tail[-300:]} if end.outcome == "failed" else {}),
        )
        self._clocks.retime(self.runs.values(), run.start.gpus)
        if run.process is not None:
            await run.process.__aexit__(None, None, None)
        successor = run.successor
        if successor is not None and end.outcome == "stopped" and not self.closing:
            await self._restart(successor, end.iteration)
        elif run.start.leader:
            # after a resize was asked for, the scheduler follows the new run's id
            run_id = run.run_id if successor is None else successor.run_id
            if successor is not None:
                self.ended[(run.job_id, run_id)] = None
            self._outbox.deliver(job_exit(self.config.name, run.job_id, run_id, end))
        self._resolve_stopped_all()

    async def _restart(self, successor: StartJob, iteration: int) -> None:
        """Start the run that replaces a resized one, from where it checkpointed."""
        start = msgspec.structs.replace(successor, resume_iteration=iteration)
        answer = await self.start(start)
        if not answer.ok:
            self.log.warning("restart after resize failed", job_id=start.job_id,
                             error=answer.error)
            self.ended[(start.job_id, start.run_id)] = None
            self._outbox.deliver(job_exit(self.config.name, start.job_id, start.run_id, RunEnd(
                "failed", iteration, None, f"restart after resize failed: {answer.error}")))
