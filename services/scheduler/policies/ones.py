"""ONES: each job's GPU count (and so its global batch) chosen by an online genetic search.

An individual has one gene per GPU holding the job on it (or none); a job's GPU count is
how many genes it holds, its global batch the job's base per-GPU batch times that count.
The population (16) lives on the policy object and advances one generation at a
decision, at most once per search interval of simulated time (``search_interval_s``;
by default 1 s per GPU of the cluster): 8 uniform per-GPU crossovers of uniformly picked
parents, one mutant per parent that drops each changeable job with probability 0.3,
every candidate repaired (sizes onto the doubling ladder, padded in two passes, laid out
contiguously with few moves), and the best 16 of the 48 kept. The best individual is
applied. A decision between generations pads the kept best individual as it was carried
out: new jobs onto idle GPUs, idle GPUs left to the running jobs in padding order.

Priorities cannot be honoured here (our choice): the search re-plans every job's size
each generation, so there is no queue order whose places a tenant's priorities could
refill. Its capabilities say so (``honours_priority``), and jobs with one are refused
instead (admission while this policy leads, ``gpusched simulate``;
docs/architecture.md, Priorities).

Fitness (lower is better; ours, see below) is minus the rate at which the placed jobs
finish: ``-sum 1 / (remaining samples at n / throughput at n + restart)`` over the jobs a
candidate places, with remaining samples = remaining iterations (``est_remaining_s`` over
the estimated iteration time at the job's current shape) x its global batch, moved to
the batch at n along the model's convergence curve, throughput at n from
``snapshot.estimates``, and ``restart_s`` added where n is not the size the job runs at;
the sum is then lowered by the share of the cluster's GPU time over ``min_run_s`` that
the restarts leave idle (``restart_s`` x the GPUs of the running jobs that change size).

Where this differs from the method's description (DESIGN.md section 5, ONES), and why:

- A new job starts at its per-GPU batch (an elastic ``Start`` with ``batch_size``) on
  one GPU, as in ONES; with ``start_on_one_gpu=False`` (ours) on one GPU or, doubling,
  on up to the GPUs it asked for (on one GPU a job spends its first epoch or
  ``min_run_s`` far below the size it asked for). An unplaced preempted job restarts at
  half its last size, on the doubling ladder.
- A job may change after one epoch at its current shape (``JobView.epoch_s``, since
  ``JobView.started_at``) or after ``min_run_s`` (120 s, four restarts), whichever comes
  first; until then it is frozen where it runs. New jobs get the same, not two epochs.
  ONES's epoch alone held jobs whose epoch is long for hours at a size.
- A running job past that gate may double once (its cap is twice its current size, and
  at most 4x the GPUs it asked for, as ONES has it); run time in the scale-down rule is
  the time since its last change.
- ONES keeps the per-GPU batch at the job's own and holds the global batch once the
  learning rate reaches ``max_lr``. Here, where the estimates know the model's
  convergence curve (``batch_search``, ours, after Pollux's goodput), a job starts or
  changes size at the global batch with the least predicted remaining time (samples
  left at that batch along the curve x the estimated iteration time / batch) among
  ONES's and per-GPU batches from a quarter to ``2 ** BATCH_SPREAD_LOG2`` times its
  own, never past the largest batch the curve was measured at (or the one it asked
  for, if larger); a job keeps its batch while it keeps its size. On the Pollux
  workloads this chooses larger per-GPU batches for ncf, yolov3 and bert, whose
  iterations cost little more at a larger batch: mean of workloads 1-8 2,751 ->
  2,451 s, workload-6 2,573 -> 2,362 s (docs/results.md). Without a curve the global
  batch is the per-GPU batch asked for x GPUs.
- Remaining samples come from ``est_remaining_s``: a simulator fills it from the
  progress predictor of ``gpusched.libs.core.progress`` (the mean of its Beta, not a sample),
  pulled towards the size estimate every policy uses until the predictor has seen
  several jobs of the data set finish; a job without a prediction counts with that
  estimate rather than adding nothing.
- ONES's fitness, the predicted remaining GPU-seconds of the placed jobs, rewards
  leaving jobs out (one job grown to the whole cluster then kept every new job waiting
  for hours); counting left-out jobs at their smallest size made admitting neutral but
  then nothing told a long job's GPUs from a short one's: on the Pollux workloads two
  imagenet jobs kept 16 GPUs each through a busy period while some 25 short jobs ran
  on one or two GPUs each, and the mean JCT was only 3 % below Tiresias's on
  workload-6. Ours sums finishing rates, so a GPU goes where it shortens the predicted
  time of a job with little left most (shortest-remaining-first, weighed by how well
  each job scales), admitting a job always helps, and a resize must save more than the
  restart it costs (a 30 s ncf job is no longer resized after its first epoch). The
  restart's own seconds are nothing to a job with hundreds of hours left, so the GPUs a
  restart idles are charged against the whole schedule's rate too: without that, long
  Philly jobs were shrunk for every shorter arrival and grown back after (20,850 resizes
  in 200 jobs against 569).
- Remaining samples at another batch follow the model's convergence curve (a larger
  batch needs more samples; ours: ONES counts the same samples at every size and bounds
  the batch by the learning rate only).
- Padding is two passes over the changeable jobs, new and running alike, in order of
  predicted remaining time on one GPU: each up to the GPUs it asked for (at least its
  start size), then each placed job up to its cap. ONES pads new jobs first, then
  executed jobs back to their current size, then growth, so a running job a mutant
  dropped always came back at its size and its GPUs never went to a shorter job.
- Over-subscribed candidates (from crossovers) shrink the jobs with the longest
  predicted remaining time first.
- Layout keeps every job that keeps its size where it runs; where a job that grows
  then finds no free contiguous block though the GPUs are there, every job (frozen
  ones excepted) is laid out again, largest first, each on the block nearest its
  GPUs (else packed from the first GPU), and a job moved at its size is charged a
  restart in the fitness like a resize (ours: before, the grown job shrank back, and
  on the Pollux workload-6 three imagenet jobs held 16 GPUs each for some 20,000 s
  beside 16 idle ones; mean of workloads 1-8 2,451 -> 2,420 s).
- Cadence. ONES runs a generation about once a second of wall time, whatever happens;
  the method's description has one at every scheduling step. Here a generation runs
  at a decision (an event, or a wake-up the policy asks for), at most once per
  ``search_interval_s`` of simulated time; a decision in between only pads the kept
  best individual (``_pad``): the queued jobs the search sees go onto idle GPUs at
  their start size, shortest predicted remaining time on one GPU first, then idle
  GPUs left go to the running jobs past their gate in the same order, up to the GPUs
  they asked for and then up to their cap where growing saves more than the restart
  (repair's two passes); nothing is shrunk, moved or preempted until the next
  generation, and the kept best individual takes the new places. Why: at Philly's
  scale (64 x 8 GPUs, 82,247 jobs, two or more events a job) a generation at every
  event took hours; a wall-clock second means nothing in a simulation, so the
  interval is simulated time, and by default 1 s per GPU of the cluster (64 s on the
  Pollux workloads' 16 x 4, 512 s on Philly's 64 x 8), since a generation's cost grows
  with the genes. ``search_interval_s=0`` is a generation at every decision, the
  decisions as before the interval existed. docs/results.md, "ONES's search interval",
  measures it.
- The simulator decides only at events, so while jobs run or wait the policy asks to be
  woken every ``min_run_s`` seconds, and no earlier than the next generation may run.
- A job that declares elastic bounds (``JobView.elastic``, ours) is sized only within
  them: its ladder of GPU counts is moved into ``min_gpus``..``max_gpus`` (a new job
  starts on ``min_gpus``), a declared ``max_gpus`` replaces the cap of 4x the GPUs it
  asked for, and only batches within ``min_batch_size``..``max_batch_size`` are tried
  (``ones_jobs.within_batch_bounds``). A job that declares none is sized as above.

What we added so the search scales (ours, not the method's):

- The search sees the running jobs and only the first ``free GPUs + queue_margin``
  queued jobs in arrival order (every new job takes at least one GPU, so padding starts
  at most that many from the idle GPUs); the rest wait with a reason naming the window.
  ONES puts every queued job in the genome; a mutant that drops running jobs could then
  start more queued jobs than the idle GPUs, here at most ``queue_margin`` more.
- A decision where no running job is past its epoch gate and no job the search sees
  fits on the idle GPUs runs no generation (none could change anything): it returns the
  reasons and a wake-up, and keeps the population as it was.
- Repair works on numpy arrays per decision (sizes, stayers, fitness), pads every job at
  once where the idle GPUs hold a whole pass, places one-GPU jobs from a heap of free
  runs, and repairs equal candidates of a generation once; it lays out exactly as the
  walk over single GPUs it replaced.

This module holds the policy and its search (which jobs it sees and what each size
costs, repair, layout, fitness, generations, when to wake up); ``ones_jobs`` a job as
the search sees it and its batch and size choices, ``ones_problem`` one decision's jobs
as the arrays repair reads, ``ones_moves`` the decision that carries out the best layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from gpusched.libs.core.decision import Decision
from gpusched.libs.core.placement import (
    exclusive_accum,
    unschedulable_reason,
)
from gpusched.libs.core.snapshot import JobView, ModelBasis, Snapshot
from gpusched.services.scheduler.policies.base import Capabilities, QueueSort
from gpusched.services.scheduler.policies.ones_jobs import (
    SearchJob,
    batch_choices,
    curve_of,
    doubling_floor,
    largest_useful_batch,
    samples_at,
    within_batch_bounds,
)
from gpusched.services.scheduler.policies.ones_moves import decision_of
from gpusched.services.scheduler.policies.ones_pad import pad
from gpusched.services.scheduler.policies.ones_problem import NONE, SearchProblem
from gpusched.services.scheduler.policies.ones_repair import layout, repair
from gpusched.services.scheduler.policies.simple import FIFO_ORDER, fifo_key

POPULATION = 16
CROSSOVERS = 8
SWAP_PROBABILITY = 0.5
DROP_PROBABILITY = 0.3
#: a job grows to at most this many times the GPUs it asked for
GROWTH_LIMIT = 4
#: generations that change nothing before the search wakes less often, and the longest
#: pause it then takes, in ``min_run_s``
QUIET_GENERATIONS = 3
MAX_BACKOFF = 64
#: ``Ones.search_s_per_gpu`` unless given (docs/results.md, "ONES's search interval")
SEARCH_S_PER_GPU = 1.0


@dataclass
class Ones:
    """Online evolutionary search over GPU counts (see the module docstring)."""

    seed: int = 0
    #: seconds a job runs at a shape before it may change again, where an epoch at that
    #: shape takes longer (see ``settling_s``)
    min_run_s: float = 120.0
    #: seconds a job loses when its GPU count changes (the restart from its checkpoint;
    #: the simulator's ``restart_overhead_s``), charged in the fitness
    restart_s: float = 30.0
    name: str = "ones"
    preemptive: bool = True
    #: ONES's rule: every new job starts on exactly one GPU. False (ours): on one GPU or,
    #: doubling, on up to the GPUs it asked for (docs/results.md measures both)
    start_on_one_gpu: bool = True
    #: queued jobs the search sees beyond the idle GPUs (see ``_window``)
    queue_margin: int = 8
    queue_sort: QueueSort | None = FIFO_ORDER
    #: choose the batch at each GPU count by predicted remaining time where the model's
    #: convergence curve is known (ours; False: ONES's per-GPU batch, see the docstring)
    batch_search: bool = True
    #: simulated seconds from one generation of the search to the next at the least
    #: (0: a generation at every decision; None: ``search_s_per_gpu`` x the cluster's
    #: GPUs); a decision in between pads the kept best individual instead (``_pad``: new
    #: jobs onto idle GPUs, idle GPUs to the running jobs in padding order)
    search_interval_s: float | None = None
    #: the interval per GPU of the cluster where ``search_interval_s`` is None: a
    #: generation costs about in proportion to the GPUs (one gene each), so the search
    #: costs about the same wall time per simulated second on any cluster
    search_s_per_gpu: float = SEARCH_S_PER_GPU
    #: this decision's ``interval_s``
    _interval: float = field(default=0.0, init=False, repr=False)
    #: generations run so far
    generations: int = field(default=0, init=False, repr=False)
    #: when the last generation ran (None: none yet)
    _last_search: float | None = field(default=None, init=False, repr=False)
    #: the wake-up the last decision that could run a generation asked for
    _next_wake: float | None = field(default=None, init=False, repr=False)
    #: running jobs as padding sees them, by (id, GPUs, batch, start, kind), kept from
    #: one generation to the next: their costs age by at most one interval
    _padding_jobs: dict[tuple[str, int, int, float, str], SearchJob] = field(
        default_factory=dict, init=False, repr=False
    )
    _rng: np.random.Generator = field(init=False, repr=False)
    #: generations in a row that changed nothing (see ``_wake_at``)
    _quiet: int = field(default=0, repr=False)
    #: the kept individuals, as indices into the job ids of the decision that kept them
    _population: list[np.ndarray] = field(default_factory=list, repr=False)
    _population_ids: list[str] = field(default_factory=list, repr=False)
    _asked: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    _basis: ModelBasis = field(default_factory=ModelBasis, repr=False)
    _shape_cache: dict[tuple[str, int, int], tuple[int | None, float]] = field(
        default_factory=dict, repr=False
    )
    #: each (model, global batch)'s iterations at its convergence curve's knots
    _curves: dict[tuple[str, int], np.ndarray] = field(default_factory=dict, repr=False)
    #: the largest useful global batch of each model (``largest_useful_batch``)
    _largest_batch: dict[str, int] = field(default_factory=dict, repr=False)
    #: why a queued shape (model, GPUs, batch) can never run here (None: it can)
    _unschedulable: dict[tuple[str, int, int], str | None] = field(
        default_factory=dict, repr=False
    )
    #: best fitness of the kept population after each decision (for inspection)
    best_fitness: float = field(default=math.inf, repr=False)

    def __post_init__(self) -> None:
        if self.queue_margin < 0:
            raise ValueError(f"queue_margin must be at least 0, got {self.queue_margin}")
        if not (self.restart_s >= 0 and math.isfinite(self.restart_s)):
            raise ValueError(f"restart_s must be a finite number >= 0, got {self.restart_s!r}")
        for name in ("search_interval_s", "search_s_per_gpu"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        self._rng = np.random.default_rng(self.seed)

    @property
    def capabilities(self) -> Capabilities:
        """The search re-plans every job's size, so a job's priority cannot order it: a
        job with one is refused (admission, simulate) rather than silently ignored. A
        driver gives converging jobs the remaining time a progress predictor (seeded as
        this search) sees in their epochs: ONES's fitness counts predicted remaining
        samples. It resizes running jobs."""
        return Capabilities(
            predicts_progress=True, progress_seed=self.seed, honours_priority=False, resizes=True
        )

    def scaled(self, time_scale: float) -> Ones:
        return Ones(
            seed=self.seed,
            min_run_s=self.min_run_s * time_scale,
            restart_s=self.restart_s * time_scale,
            name=self.name,
            queue_margin=self.queue_margin,
            start_on_one_gpu=self.start_on_one_gpu,
            batch_search=self.batch_search,
            search_interval_s=(
                None if self.search_interval_s is None else self.search_interval_s * time_scale
            ),
            search_s_per_gpu=self.search_s_per_gpu * time_scale,
        )

    def asked_gpus(self, view: JobView) -> int:
        """The GPUs ``view``'s job asked for (its size when the search first saw it)."""
        return self._asked.get(view.job_id, (view.gpus, view.batch_size))[0]

    @property
    def population(self) -> list[tuple[str | None, ...]]:
        ids = np.array([*self._population_ids, None], dtype=object)
        return [tuple(ids[genes]) for genes in self._population]

    # ---- per-shape estimates ----------------------------------------------------------
    def _shape(
        self, snapshot: Snapshot, view: JobView, batch: int, gpus: int
    ) -> tuple[int | None, float]:
        """Accumulation steps that fit the smallest GPU (None: none does) and the
        estimated iteration time, for ``view``'s model at this batch and GPU count."""
        key = (view.model, batch, gpus)
        found = self._shape_cache.get(key)
        if found is None:
            shaped = replace(view, gpus=gpus, batch_size=batch)
            accum = exclusive_accum(shaped, snapshot, snapshot.cluster.min_gpu_mem_mb)
            nodes = snapshot.cluster.fewest_nodes(gpus)
            iter_s = snapshot.estimates.iteration_time(view.model, batch, gpus, nodes, accum or 1)
            found = self._shape_cache[key] = (accum, iter_s)
        return found

    def _window(self, snapshot: Snapshot, reasons: dict[str, str]) -> tuple[list[JobView], bool]:
        """The queued jobs this decision's search sees: the first ``free GPUs +
        queue_margin`` that can run on this cluster, in arrival order (those that never
        can get their reason), and whether jobs are left behind the window."""
        room = snapshot.free_gpus + self.queue_margin
        queue = snapshot.pending
        if snapshot.queue_order != FIFO_ORDER.name:
            queue = tuple(sorted(queue, key=fifo_key))
        seen: list[JobView] = []
        for view in queue:
            if len(seen) == room:
                return seen, True
            shape = (view.model, view.gpus, view.batch_size)
            if shape not in self._unschedulable:
                self._unschedulable[shape] = unschedulable_reason(view, snapshot)
            bad = self._unschedulable[shape]
            if bad:
                reasons[view.job_id] = bad
            else:
                seen.append(view)
        return seen, False

    def _jobs(self, snapshot: Snapshot) -> tuple[list[SearchJob], dict[str, str], bool]:
        self._check_basis(snapshot)
        if len(self._asked) > 2 * (len(snapshot.running) + len(snapshot.pending)) + 64:
            present = {v.job_id for v in (*snapshot.running, *snapshot.pending)}
            self._asked = {j: asked for j, asked in self._asked.items() if j in present}
        jobs: list[SearchJob] = []
        reasons: dict[str, str] = {}
        pending, behind = self._window(snapshot, reasons)
        for view in (*sorted(snapshot.running, key=lambda v: v.job_id), *pending):
            found = self._search_job(snapshot, view, reasons)
            if found is not None:
                jobs.append(found)
        self._scale_down(snapshot, jobs)
        return jobs, reasons, behind

    def _check_basis(self, snapshot: Snapshot) -> None:
        """Forget every per-shape answer once the estimates or the cluster change."""
        if self._basis.moved(snapshot):
            self._shape_cache.clear()
            self._unschedulable.clear()
            self._largest_batch.clear()
            self._curves.clear()
            self._padding_jobs.clear()

    def _search_job(
        self, snapshot: Snapshot, view: JobView, reasons: dict[str, str]
    ) -> SearchJob | None:
        """``view``'s job as this decision's search sees it: its kind, the GPU counts it
        may hold and what each costs (None, with its reason, where no count fits)."""
        total = snapshot.cluster.total_gpus
        now = snapshot.now
        asked_gpus, asked_batch = self._asked.setdefault(
            view.job_id, (view.gpus, view.batch_size)
        )
        base = max(1, asked_batch // asked_gpus)
        if view.model not in self._largest_batch:
            self._largest_batch[view.model] = largest_useful_batch(snapshot, view.model)
        largest = max(asked_batch, self._largest_batch[view.model])

        def batch_at(
            n: int,
            asked_gpus: int = asked_gpus,
            asked_batch: int = asked_batch,
            base: int = base,
            largest: int = largest,
        ) -> int:
            # past the largest useful batch the global batch is held and the
            # per-GPU batch shrinks, as past ONES's max_lr
            return asked_batch if n == asked_gpus else max(n, min(base * n, largest))

        _, iter_now = self._shape(snapshot, view, view.batch_size, view.gpus)
        remaining_iters = view.remaining_s(now) / iter_now if iter_now > 0 else 0.0
        samples = remaining_iters * view.batch_size
        curve = curve_of(snapshot, view.model)
        bounds = view.elastic
        if not view.running:
            kind = "new"
            # a new job starts on one GPU, a preempted one at half its last size (or,
            # unless ``start_on_one_gpu``, on more, doubling, up to what it asked for)
            ladder = [doubling_floor(max(1, view.gpus // 2)) if view.preemptions else 1]
            while not self.start_on_one_gpu and ladder[-1] * 2 <= min(total, asked_gpus):
                ladder.append(ladder[-1] * 2)
        elif now - view.started_at < self.settling_s(view):
            kind = "frozen"
            ladder = [view.gpus]
        else:
            kind = "running"
            # a declared max_gpus replaces ONES's cap of 4x the GPUs asked for
            cap = GROWTH_LIMIT * asked_gpus
            if bounds is not None and bounds.max_gpus is not None:
                cap = bounds.max_gpus
            limit = min(total, cap, 2 * view.gpus)
            ladder = []
            n = 1
            while n <= limit:
                ladder.append(n)
                n *= 2
            if view.gpus not in ladder:
                ladder.append(view.gpus)
                ladder.sort()
        if bounds is not None:
            ladder = sorted({bounds.gpus_within(n) for n in ladder})
        cost: dict[int, tuple[float, int, int]] = {}
        for n in ladder:
            if n == view.gpus and view.running:
                choices = [view.batch_size]
            elif self.batch_search and curve is not None:
                choices = batch_choices(batch_at(n), base, n, largest)
            else:
                choices = [batch_at(n)]
            if bounds is not None and not (n == view.gpus and view.running):
                choices = within_batch_bounds(choices, bounds, n)
            best: tuple[float, int, int] | None = None
            for batch in choices:
                accum, iter_s = self._shape(snapshot, view, batch, n)
                if accum is None and not (kind == "frozen" or n == view.gpus):
                    continue
                # samples / (batch / iter_s): remaining seconds at n GPUs, with the
                # samples left at this batch where the convergence curve is known
                left = (
                    samples
                    if curve is None
                    else samples_at(self._curves, curve, view, samples, batch)
                )
                found = (left * iter_s / batch, accum or view.accum_steps, batch)
                if best is None or found[0] < best[0]:
                    best = found
            if best is not None:
                cost[n] = best
        sizes = sorted(cost)
        if not sizes:
            reasons[view.job_id] = "no GPU count fits its per-GPU batch in GPU memory"
            return None
        _, one_iter = self._shape(snapshot, view, base, 1)
        return SearchJob(
            view, asked_gpus, asked_batch, kind, sizes, cost, samples * one_iter / base
        )

    def _scale_down(self, snapshot: Snapshot, jobs: list[SearchJob]) -> None:
        """The single largest changeable job, if it holds at least half the cluster and
        has run longer than the median running job, is capped at
        ``max(1, int(2 size / (run_time / median + 1)))`` rounded up to even."""
        running = [j for j in jobs if j.view.running]
        if not running:
            return
        runs = sorted(snapshot.now - j.view.started_at for j in running)
        median = (
            runs[len(runs) // 2]
            if len(runs) % 2
            else (runs[len(runs) // 2 - 1] + runs[len(runs) // 2]) / 2
        )
        candidates = [j for j in running if j.kind == "running"]
        if not candidates or median <= 0:
            return
        largest = max(candidates, key=lambda j: (j.view.gpus, j.view.job_id))
        size = largest.view.gpus
        run_time = snapshot.now - largest.view.started_at
        if size * 2 < snapshot.cluster.total_gpus or run_time <= median:
            return
        cap = max(1, int(2 * size / (run_time / median + 1)))
        cap += cap % 2
        kept = [n for n in largest.sizes if n <= cap] or largest.sizes[:1]
        largest.sizes = kept

    # ---- repair -----------------------------------------------------------------------
    def _repair(self, problem: SearchProblem, genes: np.ndarray) -> np.ndarray:
        return repair(self, problem, genes)

    def _layout(self, p: SearchProblem, size: np.ndarray) -> np.ndarray:
        return layout(self, p, size)

    def _fitness(self, p: SearchProblem, genes: np.ndarray) -> float:
        """Minus the rate at which the placed jobs finish: the sum over them of one over
        the predicted remaining seconds at the size a candidate gives them, plus
        ``restart_s`` where that size is not the one they run at or the GPUs not the
        ones they run on, less the share of the cluster's GPU time over ``min_run_s``
        that the restarts leave idle (lower is better)."""
        held = np.bincount(genes[genes >= 0], minlength=len(p.jobs))
        if not len(p.jobs):
            return 0.0
        placed = held > 0
        # running jobs a candidate resizes or moves
        same = genes == p.occupancy
        kept = np.bincount(p.occupancy[same & (p.occupancy >= 0)], minlength=len(p.jobs))
        moved = (p.current > 0) & ((held != p.current) | (kept != p.current))
        at = np.where(placed, (p.ladder == held[:, None]).argmax(axis=1), 0)
        seconds = p.seconds[p.rows, at] + np.where(placed & moved, self.restart_s, 0.0)
        rate = np.where(placed, 1.0 / np.maximum(seconds, 1e-9), 0.0)
        # summed in job order (a cumulative sum), as a Python sum would: a different
        # rounding could reorder candidates of equal cost
        total = float(np.cumsum(rate)[-1])
        # the GPUs of running jobs that change size stand idle for a restart, a share
        # of the cluster's time over the ``min_run_s`` the schedule stands at least
        idle = float(np.maximum(held, p.current)[moved].sum())
        return -total * (1 - self.restart_s * idle / (p.total * max(self.min_run_s, 1e-9)))

    def _generation(self, problem: SearchProblem) -> list[tuple[float, np.ndarray]]:
        jobs, total = problem.jobs, problem.total
        index = {job.view.job_id: i for i, job in enumerate(jobs)}
        if not self._population or len(self._population[0]) != total:
            parents = [problem.occupancy.copy() for _ in range(POPULATION)]
        else:
            # old job index -> this decision's (NONE for jobs gone); NONE maps to NONE
            renumber = np.array(
                [index.get(job_id, NONE) for job_id in self._population_ids] + [NONE],
                dtype=np.int64,
            )
            parents = [renumber[genes] for genes in self._population]
        rng = self._rng
        children: list[np.ndarray] = []
        for _ in range(CROSSOVERS):
            a, b = rng.integers(0, len(parents), size=2)
            swap = rng.random(total) < SWAP_PROBABILITY
            left, right = parents[a].copy(), parents[b].copy()
            left[swap], right[swap] = parents[b][swap], parents[a][swap]
            children.extend((left, right))
        changeable = np.array([job.kind != "frozen" for job in jobs] + [False], dtype=bool)
        mutants: list[np.ndarray] = []
        for parent in parents:
            drop = (rng.random(len(jobs) + 1) < DROP_PROBABILITY) & changeable
            mutant = parent.copy()
            mutant[drop[parent]] = NONE
            mutants.append(mutant)
        scored: list[tuple[float, np.ndarray]] = []
        # equal candidates (a converged population breeds many) are repaired once
        repaired_of: dict[bytes, tuple[float, np.ndarray]] = {}
        for candidate in (*parents, *children, *mutants):
            key = candidate.tobytes()
            found = repaired_of.get(key)
            if found is None:
                repaired = self._repair(problem, candidate)
                found = repaired_of[key] = (self._fitness(problem, repaired), repaired)
            scored.append(found)
        order = sorted(range(len(scored)), key=lambda k: (scored[k][0], k))
        return [scored[k] for k in order[:POPULATION]]

    def interval_s(self, snapshot: Snapshot) -> float:
        """Simulated seconds from one generation to the next at the least, on
        ``snapshot``'s cluster."""
        if self.search_interval_s is not None:
            return self.search_interval_s
        return self.search_s_per_gpu * snapshot.cluster.total_gpus

    def decide(self, snapshot: Snapshot) -> Decision:
        self._interval = self.interval_s(snapshot)
        if self._between_searches(snapshot.now):
            return self._pad(snapshot)
        jobs, reasons, behind = self._jobs(snapshot)
        default = self._default_reason(snapshot, behind)
        if self._settled(snapshot, jobs):
            if not self._population:
                now = SearchProblem(snapshot, jobs, self.restart_s).occupancy
                self._population = [now.copy() for _ in range(POPULATION)]
                self._population_ids = [job.view.job_id for job in jobs]
            for job in jobs:
                if not job.view.running:
                    reasons[job.view.job_id] = (
                        f"needs {job.sizes[0]} GPU{'s' if job.sizes[0] > 1 else ''}; every "
                        "GPU is busy with a job that ran less than an epoch at its size"
                    )
            return Decision(
                reasons=reasons,
                default_reason=default,
                wake_at=self._spaced(self._wake_at(snapshot, jobs, False)),
            )
        kept = self._generation(SearchProblem(snapshot, jobs, self.restart_s))
        self._population = [genes for _, genes in kept]
        self._population_ids = [job.view.job_id for job in jobs]
        self.best_fitness, best = kept[0]
        self.generations += 1
        self._last_search = snapshot.now
        self._padding_jobs.clear()
        return decision_of(
            jobs,
            best,
            reasons,
            default,
            lambda changed: self._spaced(self._wake_at(snapshot, jobs, changed)),
        )

    def _default_reason(self, snapshot: Snapshot, behind: bool) -> str:
        return (
            f"waits behind the first {snapshot.free_gpus + self.queue_margin} queued jobs "
            f"(idle GPUs plus {self.queue_margin}), the only ones the search sees"
            if behind
            else "waiting for the next generation of the search"
        )

    # ---- between generations ----------------------------------------------------------
    def _between_searches(self, now: float) -> bool:
        """Whether the last generation ran less than ``search_interval_s`` ago."""
        last, interval = self._last_search, self._interval
        return interval > 0 and last is not None and now < last + interval

    def _spaced(self, wake_at: float | None) -> float | None:
        """``wake_at``, no earlier than the next generation may run; kept for the
        decisions that pad until then."""
        last = self._last_search
        if wake_at is not None and self._interval > 0 and last is not None:
            wake_at = max(wake_at, last + self._interval)
        self._next_wake = wake_at
        return wake_at

    def _pad(self, snapshot: Snapshot) -> Decision:
        return pad(self, snapshot)

    @staticmethod
    def _settled(snapshot: Snapshot, jobs: list[SearchJob]) -> bool:
        """Whether no search can change anything: no running job is past its epoch gate
        and no queued job the search sees fits on the idle GPUs."""
        if any(job.kind == "running" for job in jobs):
            return False
        idle = snapshot.free_gpus
        return all(job.sizes[0] > idle for job in jobs if job.kind == "new")

    def settling_s(self, view: JobView) -> float:
        """How long a job runs at a shape before it may change: one epoch where the
        driver knows its length (ONES's rule) and it is shorter than ``min_run_s``, else
        ``min_run_s`` (four restarts' worth by default, ours: an epoch of a job on one
        GPU can be half its training, and ONES's gate then held it there for hours)."""
        return self.min_run_s if view.epoch_s is None else min(view.epoch_s, self.min_run_s)

    def _wake_at(self, snapshot: Snapshot, jobs: list[SearchJob], changed: bool) -> float | None:
        """When to run the next generation with no event: when the first frozen job may
        change, else ``min_run_s`` on while the search moves jobs, backing off by
        doubling (up to ``MAX_BACKOFF`` times) after ``QUIET_GENERATIONS`` generations
        that changed nothing; a simulated trace would otherwise run a generation every
        ``min_run_s`` through months of steady state."""
        if not jobs:
            return None
        self._quiet = 0 if changed else self._quiet + 1
        backoff = min(MAX_BACKOFF, 2 ** max(0, self._quiet - QUIET_GENERATIONS))
        thaws = [
            j.view.started_at + self.settling_s(j.view)
            for j in jobs
            if j.kind == "frozen" and j.view.started_at + self.settling_s(j.view) > snapshot.now
        ]
        return min([*thaws, snapshot.now + self.min_run_s * backoff])
