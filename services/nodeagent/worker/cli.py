"""Command line of the worker.

Training mode (what the node agent runs) reads the job from ``GPUSCHED_*`` variables and
exits 0 when the job is done or was stopped by SIGTERM after checkpointing; 2 when the
environment or the flags are invalid (one line on stderr naming the variable or flag); 1
with a traceback on any other error. Torch is imported only after the signal handlers are
installed, so a SIGTERM that arrives while torch loads still ends in a checkpoint.

It trains the model's real architecture (``registry``, ``architectures``) or its small
stand-in from the zoo: ``--architecture`` (else ``GPUSCHED_WORKER_ARCHITECTURE``) ``real``,
``stand-in`` or ``auto`` (the default: real on a CUDA device, the stand-in on the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpusched.libs.common.embedded import free_port
from gpusched.libs.common.logging import configure_logging
from gpusched.libs.core.extras import TRAIN, MissingExtraError, require
from gpusched.libs.sdk import JobContext, JobEnvironmentError
from gpusched.libs.sdk.context import FIRST_RANK, RENDEZVOUS, WORLD_SIZE
from gpusched.services.nodeagent.worker.catalog import (
    DEFAULT_SIZES,
    PROFILE_TO_ZOO,
    ModelSpec,
    UnknownModelNameError,
    ZooModel,
    cpu_cost_for,
)
from gpusched.services.nodeagent.worker.degrees import Degrees, DegreesError, degrees_for
from gpusched.services.nodeagent.worker.registry import (
    ARCHITECTURE_CHOICES,
    ARCHITECTURE_ENV,
    EXTRA_STAND_INS,
    MODEL_ARCHITECTURES,
    ArchitectureChoice,
    InputSizeError,
    RealSpec,
    architecture_choice,
    known_names,
    unknown,
    wants_real,
)

#: appends the number of every iteration this process executes (for tests and debugging)
ITERATION_LOG_ENV = "GPUSCHED_WORKER_ITERATION_LOG"
#: pauses inside this iteration until SIGTERM (for tests of preemption mid-iteration)
HOLD_AT_ITERATION_ENV = "GPUSCHED_WORKER_HOLD_AT_ITERATION"
#: set by a node's first rank for the processes it starts: their rank on the node (they
#: also get the rendezvous, GPUSCHED_RENDEZVOUS, that rank chose for a job on one node)
LOCAL_RANK_ENV = "GPUSCHED_WORKER_RANK"
#: "0" trains a job given several GPUs on the first one only, in one process
DATA_PARALLEL_ENV = "GPUSCHED_WORKER_DATA_PARALLEL"
#: how long rank 0 waits for the other ranks to exit after it is done
RANKS_EXIT_WAIT_S = 30.0
#: model used when neither --model nor GPUSCHED_MODEL names one (runs by hand)
FALLBACK_MODEL = "mlp"
#: the learning rate when neither --lr nor GPUSCHED_BASE_LR gives one
FALLBACK_LR = 0.01
USAGE_ERROR = 2


class UsageError(ValueError):
    pass


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _batch_sizes(text: str) -> list[int]:
    return [_positive_int(part.strip()) for part in text.split(",") if part.strip()]


def _mapping_epilog() -> str:
    by_zoo: dict[ZooModel, list[str]] = {}
    for profile, zoo in PROFILE_TO_ZOO.items():
        by_zoo.setdefault(zoo, []).append(profile)
    lines = ["profile name -> zoo model (default --width/--depth):"]
    for zoo, profiles in by_zoo.items():
        width, depth = DEFAULT_SIZES[zoo]
        lines.append(f"  {', '.join(profiles)} -> {zoo} ({width}/{depth})")
    renamed = [f"{m} -> {n}" for m, n in MODEL_ARCHITECTURES.items() if m != n]
    lines += [
        "model -> real architecture (`gpusched models` lists them): the one of its name, or",
        *textwrap.wrap(", ".join(renamed), 88, initial_indent="  ", subsequent_indent="  "),
        "  names beyond the profiles: "
        + ", ".join(f"{name} (stand-in {zoo})" for name, zoo in EXTRA_STAND_INS.items()),
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpusched.services.nodeagent.worker",
        description="Train a zoo model for one gpusched job run (job from GPUSCHED_* "
        "variables), or measure iteration times with --profile.",
        epilog=_mapping_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", help="profile or zoo name; overrides GPUSCHED_MODEL")
    parser.add_argument("--width", type=_positive_int, help="hidden units / channels / d_model")
    parser.add_argument("--depth", type=_positive_int, help="hidden layers / conv blocks / layers")
    parser.add_argument("--seed", type=_non_negative_int, default=0, help="default: 0")
    parser.add_argument(
        "--lr",
        type=_positive_float,
        help="SGD learning rate at the base batch (default: GPUSCHED_BASE_LR, else 0.01)",
    )
    parser.add_argument(
        "--threads", type=_positive_int,
        help="torch CPU threads (default: one per core in GPUSCHED_CPUS, else 1)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), help="overrides GPUSCHED_DEVICE")
    parser.add_argument(
        "--architecture",
        choices=ARCHITECTURE_CHOICES,
        help=f"real architecture or small stand-in (default: {ARCHITECTURE_ENV}, else auto: "
        "real on a CUDA device, the stand-in on the CPU)",
    )
    parser.add_argument(
        "--input-size", type=_positive_int,
        help="real architectures: image side, sequence length or spectrogram frames "
        "(default: the architecture's own, see `gpusched models`)",
    )
    profiling = parser.add_argument_group("profile mode")
    profiling.add_argument(
        "--profile", action="store_true", help="measure, print JSON to stdout, do not train"
    )
    profiling.add_argument(
        "--batch-sizes", type=_batch_sizes, default=None, help="comma-separated global batches"
    )
    profiling.add_argument("--accum-steps", type=_positive_int, default=1, help="default: 1")
    profiling.add_argument("--warmup", type=_non_negative_int, default=3, help="default: 3")
    profiling.add_argument("--repeats", type=_positive_int, default=10, help="default: 10")
    return parser


def model_spec(name: str, source: str, width: int | None, depth: int | None) -> ModelSpec:
    """The stand-in of a model name (an extra architecture name's zoo model)."""
    if name.strip().lower() not in known_names():
        raise UsageError(f"{source}: {unknown(name)}")
    zoo = EXTRA_STAND_INS.get(name.strip().lower(), name)
    try:
        return ModelSpec.for_model(zoo, width=width, depth=depth)
    except UnknownModelNameError as error:
        raise UsageError(f"{source}: {error}") from None
    except ValueError as error:
        raise UsageError(f"--width/--depth: {error}") from None


def chosen_architecture(args: argparse.Namespace, environ: Mapping[str, str]) -> ArchitectureChoice:
    """``--architecture``, else the variable, else ``auto``."""
    text, source = (
        (args.architecture, "--architecture")
        if args.architecture
        else (environ.get(ARCHITECTURE_ENV, "").strip() or "auto", ARCHITECTURE_ENV)
    )
    try:
        return architecture_choice(text, source)
    except ValueError as error:
        raise UsageError(str(error)) from None


def training_spec(
    name: str, source: str, args: argparse.Namespace, choice: ArchitectureChoice, device: str
) -> ModelSpec | RealSpec:
    """What a run on ``device`` trains for ``name``: its real architecture where ``choice``
    asks for one there (``auto`` with --width/--depth: the stand-in they size), else its
    stand-in. The zoo's own names always train themselves."""
    sized = args.width is not None or args.depth is not None
    zoo_name = name.strip().lower() not in MODEL_ARCHITECTURES
    if wants_real(choice, device) and not zoo_name and not (sized and choice == "auto"):
        if sized:
            raise UsageError("--width/--depth: size a stand-in; --architecture real trains "
                             "the real architecture (see --input-size)")  # fmt: skip
        try:
            return RealSpec.for_model(name, input_size=args.input_size)
        except UnknownModelNameError as error:
            raise UsageError(f"{source}: {error}") from None
        except InputSizeError as error:
            raise UsageError(f"--input-size: {error}") from None
    if args.input_size is not None:
        raise UsageError(
            f"--input-size: sizes a real architecture, and this run trains "
            f"{'the zoo model ' + repr(name) if zoo_name else 'the stand-in'} "
            f"(--architecture {choice} on {device.split(':')[0]})"
        )
    return model_spec(name, source, args.width, args.depth)


def debug_hooks(environ: Mapping[str, str]) -> tuple[Path | None, int | None]:
    log_path = environ.get(ITERATION_LOG_ENV, "").strip()
    return (Path(log_path) if log_path else None), _int_variable(environ, HOLD_AT_ITERATION_ENV)


def _int_variable(environ: Mapping[str, str], name: str) -> int | None:
    """A worker variable's integer value, None when unset or empty."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"{name} must be an integer, got {raw!r}") from None


def _train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    ctx = JobContext.from_env()
    if args.device is not None:
        ctx = dataclasses.replace(ctx, device=args.device)
    layout = data_parallel_layout(ctx, os.environ)
    degrees = model_parallel_degrees(ctx, layout)
    if layout.rank > 0:
        ctx = dataclasses.replace(ctx, progress_file=None)
    # before torch loads (seconds): a preemption from then on still ends in a checkpoint
    ctx.install_signal_handlers()
    name, source = (
        (args.model, "--model") if args.model else (ctx.model or FALLBACK_MODEL, "GPUSCHED_MODEL")
    )
    choice = chosen_architecture(args, os.environ)
    # refused before torch loads; the device torch finds decides below
    spec: ModelSpec | RealSpec = training_spec(name, source, args, choice, ctx.device)
    if degrees is not None:
        # a model split over ranks: the (d, t, p) MLP, whatever the job's model
        spec = model_spec("mlp", source, args.width, args.depth)
    iteration_log, hold_at = debug_hooks(os.environ)
    others: list[subprocess.Popen[bytes]] = []
    if layout.world_size > 1 and layout.local_rank == 0:
        if not layout.rendezvous:
            layout = dataclasses.replace(
                layout, rendezvous=f"tcp://127.0.0.1:{free_port()}"
            )
        # started before torch loads here, so the ranks load it side by side
        others = [
            _start_rank(local, layout.rendezvous, argv) for local in range(1, layout.local_ranks)
        ]

    # torch's threads share the run's cores with its input pipeline's workers: a thread
    # spinning while it waits for work would take their time
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    from gpusched.services.nodeagent.worker.pipeline import DEFAULT_DATASET_SIZE
    from gpusched.services.nodeagent.worker.training import (
        DataParallel,
        DebugHooks,
        TrainingOptions,
        run_job,
    )

    options = TrainingOptions(
        seed=args.seed,
        learning_rate=args.lr or ctx.base_lr or FALLBACK_LR,
        max_lr=ctx.max_lr,
        base_batch_size=ctx.base_batch_size,
        dataset_size=ctx.dataset_size or DEFAULT_DATASET_SIZE,
        cpu_cost=cpu_cost_for(name),
    )
    if degrees is None:
        spec = training_spec(name, source, args, choice, ctx.torch_device())
    parallel = (
        DataParallel(
            layout.rank,
            layout.world_size,
            layout.rendezvous,
            layout.local_rank,
            local_ranks=layout.local_ranks,
        )
        if layout.world_size > 1
        else None
    )
    try:
        with ctx:
            hooks = DebugHooks(iteration_log, hold_at)
            if degrees is not None and parallel is not None:
                from gpusched.services.nodeagent.worker.dtp import run_dtp_job

                assert isinstance(spec, ModelSpec)  # the (d, t, p) MLP
                run_dtp_job(ctx, spec, options, parallel, degrees, hooks, args.threads)
            else:
                run_job(ctx, spec, options, hooks, parallel, args.threads)
    except BaseException:
        for process in others:
            process.kill()  # they would wait for this rank in a collective until it times out
        raise
    finally:
        _reap(others)
    return 0


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """Where this process sits among the ranks of its job."""

    #: rank among the job's processes on this node, and how many there are
    local_rank: int = 0
    local_ranks: int = 1
    #: global rank, and the ranks of the whole job (all nodes)
    rank: int = 0
    world_size: int = 1
    rendezvous: str = ""


def data_parallel_layout(ctx: JobContext, environ: Mapping[str, str]) -> RankLayout:
    """One rank per GPU of the job: ``GPUSCHED_GPUS`` on this node, and, for a job across
    nodes, the rendezvous, first rank and world size the node agent passes."""
    rendezvous = ctx.rendezvous
    single_node_off = environ.get(DATA_PARALLEL_ENV, "").strip() == "0"
    if not rendezvous and (single_node_off or len(ctx.gpus) < 2):
        return RankLayout()
    local_ranks = max(1, len(ctx.gpus))
    local_rank = _int_variable(environ, LOCAL_RANK_ENV) or 0
    first_rank = ctx.first_rank
    world_size = ctx.world_size or local_ranks
    if not 0 <= local_rank < local_ranks:
        raise UsageError(f"{LOCAL_RANK_ENV}: {local_rank} is outside 0..{local_ranks - 1}")
    if first_rank + local_ranks > world_size:
        raise UsageError(
            f"{WORLD_SIZE}: {world_size} ranks cannot hold ranks {first_rank}.."
            f"{first_rank + local_ranks - 1} ({FIRST_RANK} and GPUSCHED_GPUS)"
        )
    if (local_rank > 0 or first_rank > 0) and not rendezvous:
        raise UsageError(f"{RENDEZVOUS}: required for rank {first_rank + local_rank}")
    return RankLayout(local_rank, local_ranks, first_rank + local_rank, world_size, rendezvous)


def model_parallel_degrees(ctx: JobContext, layout: RankLayout) -> Degrees | None:
    """The (d, t, p) degrees of a job whose model is split over ranks (tensor or pipeline
    parallelism); None for a data-parallel or single-process job, which trains as before.
    Degrees whose product is not the job's ranks are refused naming the variable."""
    if ctx.tensor_parallel * ctx.pipeline_parallel == 1:
        return None
    try:
        return degrees_for(
            layout.world_size, ctx.data_parallel, ctx.tensor_parallel, ctx.pipeline_parallel
        )
    except DegreesError as error:
        raise UsageError(str(error)) from None


def _start_rank(local_rank: int, rendezvous: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, LOCAL_RANK_ENV: str(local_rank), RENDEZVOUS: rendezvous}
    # the same process group as this rank: a stop signal to the job reaches every rank
    return subprocess.Popen(
        [sys.executable, "-m", "gpusched.services.nodeagent.worker", *argv],
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _reap(others: list[subprocess.Popen[bytes]]) -> None:
    for process in others:
        try:
            process.wait(timeout=RANKS_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _profile(args: argparse.Namespace) -> int:
    if not args.batch_sizes:
        raise UsageError("--batch-sizes: required with --profile (e.g. --batch-sizes 8,16,32)")
    env_model = os.environ.get("GPUSCHED_MODEL", "").strip()
    if args.model:
        name, source = args.model, "--model"
    elif env_model:
        name, source = env_model, "GPUSCHED_MODEL"
    else:
        raise UsageError("--model: required with --profile unless GPUSCHED_MODEL is set")
    choice = chosen_architecture(args, os.environ)
    requested = args.device or os.environ.get("GPUSCHED_DEVICE", "").strip().lower()
    # refused before torch loads; the device torch finds decides below
    training_spec(name, source, args, choice, requested or "cpu")
    for batch_size in args.batch_sizes:
        if batch_size % args.accum_steps:
            raise UsageError(
                f"--batch-sizes: {batch_size} is not divisible by --accum-steps {args.accum_steps}"
            )

    import torch

    from gpusched.services.nodeagent.worker.profiling import profile
    from gpusched.services.nodeagent.worker.training import TrainingOptions

    torch.set_num_threads(args.threads or 1)
    cuda = torch.cuda.is_available()
    if requested == "cuda" and not cuda:
        raise UsageError("--device/GPUSCHED_DEVICE: cuda requested but not available")
    device = requested if requested in ("cuda", "cpu") else ("cuda" if cuda else "cpu")
    spec = training_spec(name, source, args, choice, device)
    report = profile(
        spec,
        args.batch_sizes,
        model_name=name,
        device=device,
        accum_steps=args.accum_steps,
        warmup=args.warmup,
        repeats=args.repeats,
        # the model's own iteration time: a profile's CPU sensitivity is a separate figure,
        # so the input pipeline does only its fixed work here
        options=TrainingOptions(seed=args.seed, learning_rate=args.lr or FALLBACK_LR),
    )
    print(json.dumps(report, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(arguments)
    configure_logging()
    try:
        require("torch", TRAIN, "the training worker")
        return _profile(args) if args.profile else _train(args, arguments)
    except (JobEnvironmentError, UsageError, MissingExtraError) as error:
        print(f"gpusched worker: error: {error}", file=sys.stderr)
        return USAGE_ERROR
