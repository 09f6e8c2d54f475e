"""Several independent simulations at once: `sweep` runs a list of picklable runs in
worker processes and hands the results back in the order of the list, so a parallel
sweep prints and writes what a serial one does.

Where the runs go (`Executor`):

- ``local`` (the default): a `ProcessPoolExecutor` of ``workers`` processes on this
  machine; one worker, or one run, runs in this process with no pool at all.
- ``dask`` / ``dask:ADDRESS``: Dask distributed (the ``dask`` extra), a `LocalCluster`
  of ``workers`` single-threaded worker processes, or the scheduler at ADDRESS
  (``tcp://host:8786``), whose workers may sit on many machines.

A run is any picklable object with a ``label``, a ``total`` (the jobs its progress
counts) and ``__call__(progress)``; `SimRun` is the one for a simulator run. Ctrl-C
cancels the runs not started, stops the running ones and raises `Interrupted` with the
results of the runs that had ended; a run that raises stops the sweep the same way and
surfaces as `RunFailed`, naming the run.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar

from gpusched.libs.core.extras import require

if TYPE_CHECKING:
    from multiprocessing.context import BaseContext

    from gpusched.libs.core.cluster import Cluster
    from gpusched.libs.core.jobs import JobSpec
    from gpusched.libs.core.perf import PerformanceModel
    from gpusched.services.scheduler.policies import Policy
    from gpusched.services.scheduler.simulation.results import SimResult
    from gpusched.services.scheduler.simulation.runner import ProgressCallback, ProgressFactory
    from gpusched.services.scheduler.simulation.simulator import SimConfig

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

EXECUTOR_KINDS = ("local", "dask")
#: a worker reports progress at most this often: the simulator calls back per event, and
#: every report crosses a pipe
PROGRESS_EVERY_S = 0.2
#: seconds a stopped worker is given to exit before it is killed
STOP_GRACE_S = 2.0


class Run(Protocol[R_co]):
    """One unit of a sweep; pickled to the worker that runs it."""

    @property
    def label(self) -> str: ...

    @property
    def total(self) -> int: ...

    def __call__(self, progress: ProgressCallback | None = None) -> R_co: ...


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep (`run_policies`'s among others), carrying the results of the
    runs that finished
    before it (``finished``, in run order) and the name of the one it stopped
    (``running``, names joined by ", " where several ran at once; None when it came
    between two runs). A caller that does not look for it sees a plain KeyboardInterrupt."""

    def __init__(
        self, finished: Sequence[SimResult], running: str | None, after: str | None = None
    ) -> None:
        # after: the run that ended last, where its result is not a SimResult
        after = after or (finished[-1].policy if finished else None)
        if running is not None:
            where = f"during polic{'ies' if ', ' in running else 'y'} {running}"
        else:
            where = f"after policy {after}" if after else "before any policy"
        super().__init__(f"interrupted {where}")
        self.finished = list(finished)
        self.running = running


class RunFailed(RuntimeError):
    """A run raised; ``label`` names it and ``error`` is what it raised (re-created in
    this process when it ran in another)."""

    def __init__(self, label: str, error: BaseException) -> None:
        super().__init__(f"run {label!r} failed: {type(error).__name__}: {error}")
        self.label = label
        self.error = error


@dataclass(frozen=True)
class SimRun:
    """The inputs of one `simulate` call. ``policy`` is a policy name (built with
    ``max_resident_slowdown`` by `make_policy`) or a picklable factory such as
    ``functools.partial(Ones, seed=3)``: the policy is built where the run runs, since
    some policies hold closures that cannot be pickled."""

    label: str
    cluster: Cluster
    jobs: Sequence[JobSpec]
    policy: str | Callable[[], Policy]
    truth: PerformanceModel
    estimates: PerformanceModel | None = None
    config: SimConfig | None = None
    max_resident_slowdown: float | None = None
    opt_bound: bool = False

    def __post_init__(self) -> None:
        if not self.label:
            raise ValueError("label must be a non-empty name for the run")
        if not (isinstance(self.policy, str) or callable(self.policy)):
            raise ValueError(f"policy must be a policy name or a factory, got {self.policy!r}")

    @property
    def total(self) -> int:
        return len(self.jobs)

    def __call__(self, progress: ProgressCallback | None = None) -> SimResult:
        from gpusched.services.scheduler.policies import make_policy
        from gpusched.services.scheduler.simulation.simulator import simulate

        if isinstance(self.policy, str):
            policy = make_policy(self.policy, max_resident_slowdown=self.max_resident_slowdown)
        else:
            policy = self.policy()
        inputs = (self.truth, self.estimates, self.config, progress)
        if not self.opt_bound:
            return simulate(self.cluster, self.jobs, policy, *inputs)
        # imported here: the integer program's scipy parts are needed by --opt-bound alone
        from gpusched.services.scheduler.simulation.synergy_opt import OptBounded

        bounded = OptBounded(policy)
        result = simulate(self.cluster, self.jobs, bounded, *inputs)
        return replace(result, opt_bound=bounded.summary())


@dataclass(frozen=True)
class Executor:
    """Where a sweep's runs go: ``kind`` local or dask; ``address`` a Dask scheduler
    (None: a LocalCluster started for the sweep)."""

    kind: str = "local"
    address: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in EXECUTOR_KINDS:
            raise ValueError(f"kind must be one of {', '.join(EXECUTOR_KINDS)}, got {self.kind!r}")
        if self.address is not None and (self.kind != "dask" or not self.address.strip()):
            raise ValueError("address applies to kind dask alone, and must not be empty")
        if self.kind == "dask":
            require("distributed", "dask", "--executor dask")

    @classmethod
    def parse(cls, spec: str) -> Executor:
        """``local``, ``dask`` or ``dask:ADDRESS`` (e.g. ``dask:tcp://10.0.0.5:8786``)."""
        kind, colon, address = spec.strip().partition(":")
        return cls(kind.lower(), address.strip() if colon else None)

    def __str__(self) -> str:
        return self.kind if self.address is None else f"{self.kind}:{self.address}"


def default_workers() -> int:
    return os.cpu_count() or 1


def sweep(
    runs: Sequence[Run[R]],
    workers: int | None = None,
    executor: Executor | None = None,
    progress_factory: ProgressFactory | None = None,
    on_finished: Callable[[R], None] | None = None,
) -> list[R]:
    """The result of every run, in the order of ``runs``.

    ``workers`` (default: the cores) runs at a time; ``progress_factory(label, total)``
    gives the progress callback of a run as it starts (not with a Dask executor, whose
    workers report nothing back until they finish); ``on_finished(result)`` hears of
    each run as it ends, in the order of ``runs`` whatever the order they end in (so
    what it prints is what a serial sweep prints).
    """
    executor = executor or Executor()
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if executor.kind == "dask":
        return _on_dask(runs, workers, executor.address, on_finished)
    if workers == 1 or len(runs) <= 1:
        return _serial(runs, progress_factory, on_finished)
    return _on_pool(runs, min(workers, len(runs)), progress_factory, on_finished)


def _interrupted(
    runs: Sequence[Run[Any]], results: dict[int, Any], running: Sequence[str]
) -> KeyboardInterrupt:
    """`Interrupted` with the results so far in the order of ``runs`` (``results`` holds
    them in the order they ended)."""
    last = runs[list(results)[-1]].label if results else None
    finished = [results[i] for i in sorted(results)]
    return Interrupted(finished, ", ".join(running) or None, after=last)


def _serial(
    runs: Sequence[Run[R]],
    progress_factory: ProgressFactory | None,
    on_finished: Callable[[R], None] | None,
) -> list[R]:
    results: dict[int, R] = {}
    running: list[str] = []
    try:
        for i, run in enumerate(runs):
            running = [run.label]
            progress = progress_factory(run.label, run.total) if progress_factory else None
            try:
                results[i] = run(progress)
            except Exception as exc:
                raise RunFailed(run.label, exc) from exc
            running = []
            if on_finished is not None:
                on_finished(results[i])
    except KeyboardInterrupt:
        raise _interrupted(runs, results, running) from None
    return list(results.values())


# ---------------------------------------------------------------------- local processes


#: set in each pool worker by `_start_worker`: where its runs report progress
_reports: Any = None


def _context() -> BaseContext:
    """forkserver where there is one: fork copies whatever threads (a progress bar's,
    torch's) hold their locks at that instant, and spawn re-imports the simulator for
    every worker; the fork server imports it once and forks clean children from it."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # __main__ so runs defined in a script unpickle; the rest is what every run imports
    context.set_forkserver_preload(
        ["__main__", __name__, "gpusched.services.scheduler.simulation.runner"]
    )
    return context


def _start_worker(reports: Any) -> None:
    # Ctrl-C at a terminal reaches the whole process group: the parent stops the
    # workers itself, so a worker must not die of it mid-run with a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    global _reports
    _reports = reports


class _Reporter:
    """The progress callback inside a worker: forwards (index, done, total), at most
    every `PROGRESS_EVERY_S` and always the last count."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.sent = (-1, 0.0)

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done != self.sent[0] and (done >= total or now - self.sent[1] >= PROGRESS_EVERY_S):
            self.sent = (done, now)
            _reports.put((self.index, done, total))


def _run_in_worker(index: int, run: Run[R]) -> R:
    _reports.put((index, None, run.total))  # started
    try:
        return run(_Reporter(index))
    except Exception as exc:
        _raise_portable(exc)


class _Carried(Exception):
    """An exception whose class cannot be re-created from its pickle (an ``__init__``
    taking other arguments than its message): its class, args and attributes, made
    back into it by `_arrived` on this side."""

    def __init__(self, kind: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]):
        super().__init__(kind, args, state)


def _raise_portable(error: Exception) -> NoReturn:
    """Raise ``error`` as it can travel back: a class that cannot be re-created from
    its pickle would break the whole pool instead of failing its own run."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        # from error: the traceback text sent back then holds the original's
        raise _Carried(type(error), error.args, dict(vars(error))) from error
    raise error


def _arrived(error: Exception) -> BaseException:
    if not isinstance(error, _Carried):
        return error
    kind, args, state = error.args
    rebuilt: BaseException = kind.__new__(kind)
    rebuilt.args = args
    vars(rebuilt).update(state)
    rebuilt.__cause__ = error.__cause__  # the worker's traceback, as text
    return rebuilt


class _Relay:
    """A thread turning the workers' reports into the parent's progress callbacks, and
    knowing which runs have started."""

    def __init__(self, reports: Any, runs: Sequence[Run[Any]], factory: ProgressFactory | None):
        self.reports = reports
        self.runs = runs
        self.factory = factory
        self.started: dict[int, ProgressCallback | None] = {}
        self.stop = threading.Event()
        # a daemon: a worker killed mid-report must never keep the parent from exiting
        self.thread = threading.Thread(target=self._relay, name="sweep-progress", daemon=True)
        self.thread.start()

    def _relay(self) -> None:
        while not self.stop.is_set():
            try:
                index, done, total = self.reports.get(timeout=0.1)
            except queue.Empty:
                continue
            except (EOFError, OSError, ValueError):  # the pool is being torn down
                return
            if index not in self.started:
                label = self.runs[index].label
                self.started[index] = self.factory(label, total) if self.factory else None
            callback = self.started[index]
            if done is not None and callback is not None:
                callback(done, total)


def _on_pool(
    runs: Sequence[Run[R]],
    workers: int,
    progress_factory: ProgressFactory | None,
    on_finished: Callable[[R], None] | None,
) -> list[R]:
    context = _context()
    reports = context.Queue()
    pool = ProcessPoolExecutor(workers, context, initializer=_start_worker, initargs=(reports,))
    relay = _Relay(reports, runs, progress_factory)
    results: dict[int, R] = {}
    clean = False
    try:
        futures = [pool.submit(_run_in_worker, i, run) for i, run in enumerate(runs)]
        _gather(_as_they_end(futures), runs, results, on_finished)
        clean = True
    except KeyboardInterrupt:
        running = [runs[i].label for i in sorted(relay.started) if i not in results]
        raise _interrupted(runs, results, running) from None
    finally:
        _close_pool(pool, clean)
        relay.stop.set()
        relay.thread.join(timeout=1.0)
        reports.close()
        reports.cancel_join_thread()  # a killed worker may have left it half-read
    return [results[i] for i in range(len(runs))]


def _as_they_end(futures: Sequence[Future[R]]) -> Iterator[tuple[int, Future[R]]]:
    """(index, future) of each future as it ends; those ending together in list order."""
    index_of = {future: i for i, future in enumerate(futures)}
    pending = set(futures)
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for future in sorted(done, key=index_of.__getitem__):
            yield index_of[future], future


def _gather(
    ended: Iterable[tuple[int, Any]],
    runs: Sequence[Run[R]],
    results: dict[int, R],
    on_finished: Callable[[R], None] | None,
) -> None:
    """Fill ``results`` from futures (of either executor) as they end, and tell
    ``on_finished`` of them in the order of ``runs``, as a serial sweep does (a fast run
    is told of once the runs before it have ended); a run that raised stops it with
    `RunFailed`."""
    told = 0
    for i, future in ended:
        try:
            results[i] = future.result()
        except Exception as exc:
            error = _arrived(exc)
            raise RunFailed(runs[i].label, error) from error
        while told in results:
            told += 1
            if on_finished is not None:
                on_finished(results[told - 1])


def _close_pool(pool: ProcessPoolExecutor, clean: bool) -> None:
    if clean:
        pool.shutdown(wait=True)
        return
    # ProcessPoolExecutor can only cancel runs not yet started; the started ones are
    # stopped by ending their processes, which also keeps exit from waiting on them
    handles = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in handles:
        process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in handles:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()


# ---------------------------------------------------------------------------- dask


def _call(run: Run[R]) -> R:
    try:
        return run(None)
    except Exception as exc:
        _raise_portable(exc)


def _on_dask(
    runs: Sequence[Run[R]],
    workers: int,
    address: str | None,
    on_finished: Callable[[R], None] | None,
) -> list[R]:
    from distributed import Client, LocalCluster, as_completed

    cluster = None
    if address is None:
        cluster = LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None
        )
    client = Client(cluster if cluster is not None else address)
    results: dict[int, R] = {}
    futures: list[Any] = []
    try:
        # pure=False: two runs alike (the same policy twice) are still two runs
        futures = [client.submit(_call, run, pure=False) for run in runs]
        index_of = {future.key: i for i, future in enumerate(futures)}
        ended = ((index_of[future.key], future) for future in as_completed(futures))
        _gather(ended, runs, results, on_finished)
    except KeyboardInterrupt:
        # the scheduler does not say which of the unfinished runs a worker holds
        running = [runs[i].label for i in range(len(runs)) if i not in results]
        raise _interrupted(runs, results, running) from None
    finally:
        if futures:
            client.cancel(futures)
        client.close()
        if cluster is not None:
            cluster.close()
    return [results[i] for i in range(len(runs))]
