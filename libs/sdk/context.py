"""The job context: what gpusched tells a training process, and what the process tells back.

The node agent starts every job process with ``GPUSCHED_*`` environment variables (see
:data:`ENV_VARIABLES`) and reads back JSON lines that the process appends to
``GPUSCHED_PROGRESS_FILE``. It preempts a job with SIGTERM: the process finishes its
current iteration, saves a checkpoint, writes a ``checkpoint`` line and exits 0.

A process counts as running under gpusched when ``GPUSCHED_JOB_ID`` is set; every variable
in :data:`REQUIRED_UNDER_GPUSCHED` must then be present. Without it the same script runs
by hand: every variable falls back to a default and progress lines are not written unless
``GPUSCHED_PROGRESS_FILE`` is given.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any, Literal

from gpusched.libs.common import settings
from gpusched.libs.common.settings import Setting, SettingError, load

JOB_ID = "GPUSCHED_JOB_ID"
RUN_ID = "GPUSCHED_RUN_ID"
MODEL = "GPUSCHED_MODEL"
BATCH_SIZE = "GPUSCHED_BATCH_SIZE"
ACCUM_STEPS = "GPUSCHED_ACCUM_STEPS"
GPUS = "GPUSCHED_GPUS"
DEVICE = "GPUSCHED_DEVICE"
TOTAL_ITERATIONS = "GPUSCHED_TOTAL_ITERATIONS"
START_ITERATION = "GPUSCHED_START_ITERATION"
CHECKPOINT_DIR = "GPUSCHED_CHECKPOINT_DIR"
CHECKPOINT_EVERY = "GPUSCHED_CHECKPOINT_EVERY"
PROGRESS_FILE = "GPUSCHED_PROGRESS_FILE"
#: the name of the node the process runs on (for its logs; nothing reads it back)
NODE = "GPUSCHED_NODE"
#: a job across nodes: where its ranks meet, this node's first rank, all ranks of the job
RENDEZVOUS = "GPUSCHED_RENDEZVOUS"
FIRST_RANK = "GPUSCHED_FIRST_RANK"
WORLD_SIZE = "GPUSCHED_WORLD_SIZE"
#: the CPU cores the process is pinned to (comma-separated core ids) and the host memory
#: (GB) it may use, when the scheduler allocated them; a reallocation while the job runs
#: re-pins the process and rewrites the allocation file (JSON ``{"cpus": [...], "mem_gb": x}``)
CPUS = "GPUSCHED_CPUS"
MEM_GB = "GPUSCHED_MEM_GB"
ALLOCATION_FILE = "GPUSCHED_ALLOCATION_FILE"
#: the job's options, when it gives them: samples in its data set (an epoch), and its
#: learning rate at a global batch of GPUSCHED_BASE_BATCH_SIZE, which scales linearly
#: with the batch up to GPUSCHED_MAX_LR
DATASET_SIZE = "GPUSCHED_DATASET_SIZE"
BASE_LR = "GPUSCHED_BASE_LR"
MAX_LR = "GPUSCHED_MAX_LR"
BASE_BATCH_SIZE = "GPUSCHED_BASE_BATCH_SIZE"
#: the job's parallelism degrees: data-parallel replicas, tensor-parallel and pipeline
#: ranks; their product is the job's ranks (rank = (replica * p + stage) * t + tensor)
DATA_PARALLEL = "GPUSCHED_DATA_PARALLEL"
TENSOR_PARALLEL = "GPUSCHED_TENSOR_PARALLEL"
PIPELINE_PARALLEL = "GPUSCHED_PIPELINE_PARALLEL"

#: every variable the node agent sets for a job process (besides CUDA_VISIBLE_DEVICES)
ENV_VARIABLES = (
    JOB_ID, RUN_ID, MODEL, BATCH_SIZE, ACCUM_STEPS, GPUS, DEVICE, TOTAL_ITERATIONS,
    START_ITERATION, CHECKPOINT_DIR, CHECKPOINT_EVERY, PROGRESS_FILE, NODE, RENDEZVOUS,
    FIRST_RANK, WORLD_SIZE, CPUS, MEM_GB, ALLOCATION_FILE, DATASET_SIZE, BASE_LR, MAX_LR,
    BASE_BATCH_SIZE, DATA_PARALLEL, TENSOR_PARALLEL, PIPELINE_PARALLEL,
)  # fmt: skip
#: without these a job cannot run or be tracked, so under gpusched their absence is an error
REQUIRED_UNDER_GPUSCHED = (
    JOB_ID, RUN_ID, MODEL, BATCH_SIZE, ACCUM_STEPS, TOTAL_ITERATIONS, CHECKPOINT_DIR,
    PROGRESS_FILE,
)  # fmt: skip

#: defaults of a run by hand (outside gpusched)
STANDALONE_JOB_ID = "local"
STANDALONE_BATCH_SIZE = 32
STANDALONE_TOTAL_ITERATIONS = 100
DEFAULT_CHECKPOINT_EVERY = 50
#: progress lines are rate-limited to one per this many seconds (plus forced ones)
DEFAULT_PROGRESS_INTERVAL_S = 0.5
CHECKPOINT_FILE_NAME = "checkpoint.pt"

Device = Literal["cuda", "cpu"]
ProgressEvent = Literal["progress", "checkpoint", "done"]


class JobEnvironmentError(SettingError):
    """A job variable is missing or invalid; ``variable`` names it."""

    def __init__(self, variable: str, problem: str, *, field_name: str | None = None) -> None:
        super().__init__(variable, problem)
        if field_name is not None:
            self.args = (f"{field_name} ({variable}): {problem}",)


def _field_error(field_name: str, variable: str, problem: str) -> JobEnvironmentError:
    return JobEnvironmentError(variable, problem, field_name=field_name)


@dataclass(kw_only=True)
class JobContext:
    """One run of one job: its parameters plus the progress, signal and checkpoint helpers.

    Build it with :meth:`from_env`. The clocks are injectable so that rate limiting can be
    tested without waiting.
    """

    job_id: str
    run_id: int = 0
    model: str | None = None
    batch_size: int
    accum_steps: int = 1
    gpus: tuple[int, ...] = ()
    device: Device = "cpu"
    total_iterations: int
    start_iteration: int = 0
    checkpoint_dir: Path
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY
    progress_file: Path | None = None
    #: a job across nodes: where its ranks meet ('' for a job on one node), the global
    #: rank of this node's first GPU, and the ranks of the whole job (0: this node's GPUs)
    rendezvous: str = ""
    first_rank: int = 0
    world_size: int = 0
    #: the allocated CPU cores (empty: none allocated) and host memory in GB (None: none)
    cpus: tuple[int, ...] = ()
    mem_gb: float | None = None
    allocation_file: Path | None = None
    #: the job's options (None: not given)
    dataset_size: int | None = None
    base_lr: float | None = None
    max_lr: float | None = None
    base_batch_size: int | None = None
    #: parallelism degrees (data_parallel None: the ranks over tensor x pipeline)
    data_parallel: int | None = None
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S
    monotonic: Callable[[], float] = field(default=time.monotonic, repr=False)
    wall_clock: Callable[[], float] = field(default=time.time, repr=False)

    _stop_requested: bool = field(default=False, init=False, repr=False)
    _progress_stream: IO[str] | None = field(default=None, init=False, repr=False)
    _window_start: float = field(default=0.0, init=False, repr=False)
    _window_samples: float = field(default=0.0, init=False, repr=False)
    _last_emit: float | None = field(default=None, init=False, repr=False)
    _last_rate: float = field(default=0.0, init=False, repr=False)
    _last_loss: float | None = field(default=None, init=False, repr=False)
    _metrics: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _pending_iteration: int | None = field(default=None, init=False, repr=False)
    _allocation_stamp: tuple[int, int, int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.job_id:
            raise _field_error("job_id", JOB_ID, "must not be empty")
        if self.run_id < 0:
            raise _field_error("run_id", RUN_ID, f"must be >= 0, got {self.run_id}")
        if self.batch_size < 1:
            raise _field_error("batch_size", BATCH_SIZE, f"must be >= 1, got {self.batch_size}")
        if self.accum_steps < 1:
            raise _field_error("accum_steps", ACCUM_STEPS, f"must be >= 1, got {self.accum_steps}")
        if self.batch_size % self.accum_steps:
            raise _field_error(
                "batch_size",
                BATCH_SIZE,
                f"{self.batch_size} is not divisible by accum_steps ({ACCUM_STEPS}) "
                f"= {self.accum_steps}: each accumulation step takes an equal share",
            )
        if any(gpu < 0 for gpu in self.gpus):
            raise _field_error("gpus", GPUS, f"must be non-negative indices, got {self.gpus}")
        if self.device not in ("cuda", "cpu"):
            raise _field_error("device", DEVICE, f"must be 'cuda' or 'cpu', got {self.device!r}")
        if self.total_iterations < 1:
            raise _field_error(
                "total_iterations", TOTAL_ITERATIONS, f"must be >= 1, got {self.total_iterations}"
            )
        if not 0 <= self.start_iteration <= self.total_iterations:
            raise _field_error(
                "start_iteration",
                START_ITERATION,
                f"must be within [0, {self.total_iterations}], got {self.start_iteration}",
            )
        if self.checkpoint_every < 1:
            raise _field_error(
                "checkpoint_every", CHECKPOINT_EVERY, f"must be >= 1, got {self.checkpoint_every}"
            )
        if self.first_rank < 0:
            raise _field_error("first_rank", FIRST_RANK, f"must be >= 0, got {self.first_rank}")
        if self.world_size < 0:
            raise _field_error("world_size", WORLD_SIZE, f"must be >= 0, got {self.world_size}")
        if any(core < 0 for core in self.cpus):
            raise _field_error("cpus", CPUS, f"must be non-negative core ids, got {self.cpus}")
        if self.mem_gb is not None and not (math.isfinite(self.mem_gb) and self.mem_gb >= 0):
            raise _field_error("mem_gb", MEM_GB, f"must be a number >= 0, got {self.mem_gb}")
        if self.allocation_file is not None:
            self.allocation_file = Path(self.allocation_file)
        for name, variable, value in (
            ("dataset_size", DATASET_SIZE, self.dataset_size),
            ("base_lr", BASE_LR, self.base_lr),
            ("max_lr", MAX_LR, self.max_lr),
            ("base_batch_size", BASE_BATCH_SIZE, self.base_batch_size),
        ):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise _field_error(name, variable, f"must be > 0, got {value}")
        for name, variable, degree in (
            ("data_parallel", DATA_PARALLEL, self.data_parallel),
            ("tensor_parallel", TENSOR_PARALLEL, self.tensor_parallel),
            ("pipeline_parallel", PIPELINE_PARALLEL, self.pipeline_parallel),
        ):
            if degree is not None and degree < 1:
                raise _field_error(name, variable, f"must be >= 1, got {degree}")
        if self.progress_interval_s < 0:
            raise ValueError(f"progress_interval_s must be >= 0, got {self.progress_interval_s}")
        self.checkpoint_dir = Path(self.checkpoint_dir)
        if self.progress_file is not None:
            self.progress_file = Path(self.progress_file)
        self._window_start = self.monotonic()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> JobContext:
        """Read the job variables; raise :class:`JobEnvironmentError` naming a bad one."""
        env = os.environ if environ is None else environ
        if JOB_ID in env:
            for name in (n for n in REQUIRED_UNDER_GPUSCHED if n != JOB_ID):
                if not env.get(name, "").strip():
                    missing = "empty" if name in env else "not set"
                    raise JobEnvironmentError(
                        name, f"{missing} (required because {JOB_ID} is set)"
                    )
        try:
            values = load(ENVIRONMENT, env)
        except SettingError as exc:
            raise JobEnvironmentError(exc.variable, exc.problem) from None
        # unlike the others, a job id that is set but empty is refused, not defaulted
        job_id = env.get(JOB_ID, STANDALONE_JOB_ID).strip()
        values.setdefault("batch_size", STANDALONE_BATCH_SIZE)
        values.setdefault("total_iterations", STANDALONE_TOTAL_ITERATIONS)
        values.setdefault("device", "cuda" if values.get("gpus") else "cpu")
        values.setdefault(
            "checkpoint_dir", Path("gpusched-checkpoints") / (job_id or STANDALONE_JOB_ID)
        )
        return cls(job_id=job_id, **values)

    # ------------------------------------------------------------------ derived values

    @property
    def micro_batch_size(self) -> int:
        """Samples per accumulation step: the global batch split into ``accum_steps``."""
        return self.batch_size // self.accum_steps

    @property
    def checkpoint_path(self) -> Path:
        return self.checkpoint_dir / CHECKPOINT_FILE_NAME

    @property
    def cpu_threads(self) -> int:
        """Compute threads to use: one per allocated core (1 when none are allocated)."""
        return max(1, len(self.cpus))

    def refresh_allocation(self) -> bool:
        """Re-read the allocation file if it changed since the last look (a reallocation
        while the job runs); True when ``cpus`` or ``mem_gb`` changed. One ``stat`` when
        nothing changed, so it is cheap enough to call every iteration."""
        if self.allocation_file is None:
            return False
        try:
            status = self.allocation_file.stat()
            # the agent replaces the file: a new inode even within one clock tick
            stamp = (status.st_ino, status.st_mtime_ns, status.st_size)
            if stamp == self._allocation_stamp:
                return False
            allocation = json.loads(self.allocation_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False  # not written yet, or being replaced: look again next time
        self._allocation_stamp = stamp
        cpus = tuple(int(core) for core in allocation.get("cpus", ()))
        mem_gb = allocation.get("mem_gb")
        mem_gb = None if mem_gb is None else float(mem_gb)
        changed = (cpus, mem_gb) != (self.cpus, self.mem_gb)
        self.cpus, self.mem_gb = cpus, mem_gb
        return changed

    def torch_device(self) -> str:
        """``"cuda"`` when asked for and available, else ``"cpu"`` (emulated or CPU-only)."""
        if self.device == "cuda":
            import torch

            if torch.cuda.is_available():
                return "cuda"
        return "cpu"

    # ------------------------------------------------------------------ signals

    @property
    def should_stop(self) -> bool:
        """True once SIGTERM (or SIGINT) arrived: checkpoint at the current iteration, exit 0."""
        return self._stop_requested

    def request_stop(self) -> None:
        self._stop_requested = True

    def install_signal_handlers(self) -> None:
        """Turn SIGTERM and SIGINT into :attr:`should_stop`; call from the main thread.

        A second SIGINT raises KeyboardInterrupt so that a run by hand can still be killed.
        """

        def on_terminate(signum: int, frame: FrameType | None) -> None:
            self._stop_requested = True

        def on_interrupt(signum: int, frame: FrameType | None) -> None:
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True

        signal.signal(signal.SIGTERM, on_terminate)
        signal.signal(signal.SIGINT, on_interrupt)

    # ------------------------------------------------------------------ progress

    def start_clock(self) -> None:
        """Start measuring throughput now (call once setup and checkpoint loading are over)."""
        self._window_start = self.monotonic()
        self._window_samples = 0.0

    def report(
        self,
        iteration: int,
        *,
        loss: float | None = None,
        samples: float | None = None,
        gpu_mem_mb: float | None = None,
        force: bool = False,
        metrics: Mapping[str, Any] | None = None,
    ) -> bool:
        """Record that ``iteration`` iterations are complete; maybe write a progress line.

        ``samples`` is what this iteration processed (default: the global batch). Lines are
        written at most every :attr:`progress_interval_s` unless ``force``; samples/s covers
        everything since the previous line. ``metrics`` (JSON numbers, strings or None;
        e.g. epochs done, learning rate, accuracy) go into this and every later line until
        replaced. Returns whether a line was written.
        """
        self._window_samples += self.batch_size if samples is None else samples
        if loss is not None:
            self._last_loss = loss
        if metrics is not None:
            self._metrics = {
                key: None if isinstance(value, float) and not math.isfinite(value) else value
                for key, value in metrics.items()
            }
        self._pending_iteration = iteration
        now = self.monotonic()
        due = self._last_emit is None or now - self._last_emit >= self.progress_interval_s
        if not (force or due):
            return False
        self._emit("progress", iteration, gpu_mem_mb)
        return True

    def checkpointed(self, iteration: int, *, gpu_mem_mb: float | None = None) -> None:
        """Announce that a checkpoint at ``iteration`` is durably saved."""
        self._flush_pending(gpu_mem_mb)
        self._emit("checkpoint", iteration, gpu_mem_mb)

    def done(self, iteration: int | None = None, *, gpu_mem_mb: float | None = None) -> None:
        """Announce that all iterations are complete (``iteration`` defaults to the total)."""
        final = self.total_iterations if iteration is None else iteration
        self._flush_pending(gpu_mem_mb)
        self._emit("done", final, gpu_mem_mb)

    def close(self) -> None:
        if self._progress_stream is not None:
            self._progress_stream.close()
            self._progress_stream = None

    def __enter__(self) -> JobContext:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def memory_mb(self) -> float:
        """Peak CUDA memory allocated by this process on cuda, else its resident set size."""
        torch = sys.modules.get("torch")
        if torch is not None and self.device == "cuda" and torch.cuda.is_initialized():
            return float(torch.cuda.max_memory_allocated()) / 2**20
        return resident_set_mb()

    def _flush_pending(self, gpu_mem_mb: float | None) -> None:
        if self._pending_iteration is not None:
            self._emit("progress", self._pending_iteration, gpu_mem_mb)

    def _emit(self, event: ProgressEvent, iteration: int, gpu_mem_mb: float | None) -> None:
        now = self.monotonic()
        elapsed = now - self._window_start
        if self._window_samples > 0 and elapsed > 0:
            self._last_rate = self._window_samples / elapsed
        self._window_start = now
        self._window_samples = 0.0
        self._last_emit = now
        if event == "progress":
            self._pending_iteration = None
        if self.progress_file is None:
            return
        loss = self._last_loss
        line = {
            "event": event,
            "iteration": iteration,
            "samples_per_s": self._last_rate,
            "loss": loss if loss is not None and math.isfinite(loss) else None,
            "gpu_mem_mb": self.memory_mb() if gpu_mem_mb is None else gpu_mem_mb,
            "at": self.wall_clock(),
        }
        line.update(self._metrics)
        line.update(_cpu_use())
        stream = self._progress_stream
        if stream is None:
            self.progress_file.parent.mkdir(parents=True, exist_ok=True)
            stream = self._progress_stream = self.progress_file.open("a", encoding="utf-8")
        stream.write(json.dumps(line) + "\n")
        stream.flush()

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, state: Any) -> Path:
        """Save ``state`` with torch.save so that a crash leaves the old or the new file whole."""
        return save_atomically(state, self.checkpoint_path)

    def load_checkpoint(
        self, *, weights_only: bool = True, map_location: str | None = "cpu"
    ) -> Any | None:
        """The last saved state, or None when this job has no checkpoint yet.

        ``weights_only`` keeps unpickling safe (tensors, numbers, strings and containers,
        which covers model and optimizer state dicts and torch RNG states); pass False only
        for a checkpoint holding other Python objects.
        """
        import torch

        if not self.checkpoint_path.exists():
            return None
        return torch.load(
            self.checkpoint_path, weights_only=weights_only, map_location=map_location
        )


def save_atomically(state: Any, path: Path) -> Path:
    """torch.save to a temporary file beside ``path``, fsync, then os.replace it over ``path``."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def _fsync_directory(directory: Path) -> None:
    # the rename itself is only durable once the directory entry is flushed
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def resident_set_mb() -> float:
    """Current resident set size of this process in MiB (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # ru_maxrss is in KiB on Linux and in bytes on macOS
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


# ---------------------------------------------------------------------- parsing

#: field -> the job variable ``JobContext.from_env`` reads it from (besides the job id);
#: unset or empty keeps the default of a run by hand
def _cpu_use() -> dict[str, Any]:
    """The cores this process really runs on and torch's thread count (when torch is
    loaded), so that an allocation can be checked from the progress file."""
    use: dict[str, Any] = {}
    if hasattr(os, "sched_getaffinity"):
        use["affinity"] = sorted(os.sched_getaffinity(0))
    torch = sys.modules.get("torch")
    if torch is not None:
        use["threads"] = torch.get_num_threads()
    return use


ENVIRONMENT: dict[str, Setting[Any]] = {
    "run_id": Setting(RUN_ID, settings.integer()),
    "model": Setting(MODEL, settings.text()),
    "batch_size": Setting(BATCH_SIZE, settings.integer()),
    "accum_steps": Setting(ACCUM_STEPS, settings.integer()),
    "gpus": Setting(GPUS, settings.integers(low=0)),
    "device": Setting(DEVICE, settings.one_of("cuda", "cpu")),
    "total_iterations": Setting(TOTAL_ITERATIONS, settings.integer()),
    "start_iteration": Setting(START_ITERATION, settings.integer()),
    "checkpoint_dir": Setting(CHECKPOINT_DIR, settings.path()),
    "checkpoint_every": Setting(CHECKPOINT_EVERY, settings.integer()),
    "progress_file": Setting(PROGRESS_FILE, settings.path()),
    "rendezvous": Setting(RENDEZVOUS, settings.text()),
    "first_rank": Setting(FIRST_RANK, settings.integer()),
    "world_size": Setting(WORLD_SIZE, settings.integer()),
    "cpus": Setting(CPUS, settings.integers(low=0)),
    "mem_gb": Setting(MEM_GB, settings.number(0)),
    "allocation_file": Setting(ALLOCATION_FILE, settings.path()),
    "dataset_size": Setting(DATASET_SIZE, settings.integer(low=1)),
    "base_lr": Setting(BASE_LR, settings.number(0, above=True)),
    "max_lr": Setting(MAX_LR, settings.number(0, above=True)),
    "base_batch_size": Setting(BASE_BATCH_SIZE, settings.integer(low=1)),
    "data_parallel": Setting(DATA_PARALLEL, settings.integer(low=1)),
    "tensor_parallel": Setting(TENSOR_PARALLEL, settings.integer(low=1)),
    "pipeline_parallel": Setting(PIPELINE_PARALLEL, settings.integer(low=1)),
}
