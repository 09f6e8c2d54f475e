"""The worker's input pipeline: every sample is decoded and augmented on the CPU.

A job's data set is ``size`` raw records, small RGB "files" whose bytes are a hash of the
seed and the record's index. Before the model sees a sample it is

1. decoded: ``decode_passes`` filter passes over the raw record (what a cache of decoded
   records saves on the next epoch), then
2. augmented, differently in every epoch: a random crop, a random flip, a random
   brightness, ``augment_passes`` more filter passes and the normalisation.

The passes per sample are the model's :class:`CpuCost`, so a model that the profiles find
CPU-bound really is. The data set is read in epochs, each in its own order (a permutation
drawn from the seed and the epoch), so sample ``p`` of the stream (``p`` samples seen
before it) is the same whatever the batch sizes before it were.

With two or more cores the samples of a batch are split over as many worker processes
(forked, one torch thread each, like a torch DataLoader's workers) and the next batch is
prepared while the model trains on this one; with one core everything runs in the
training process. Either way the result
is the same, sample for sample.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import math
import multiprocessing
import multiprocessing.process
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor
from torch.nn import functional

from gpusched.services.nodeagent.worker.catalog import CpuCost

#: a raw record: 3 channels of RECORD_SIZE x RECORD_SIZE bytes
RECORD_CHANNELS = 3
RECORD_SIZE = 20
RECORD_BYTES = RECORD_CHANNELS * RECORD_SIZE * RECORD_SIZE
#: what augmentation crops out of a decoded record (the models' input size)
IMAGE_SIZE = 16
#: a data set's size when the job gives none
DEFAULT_DATASET_SIZE = 4096
#: what a cache entry costs beyond its bytes (the array object and the dict slot)
ENTRY_OVERHEAD_BYTES = 256
GIB = 2**30
#: the cache of a run without a memory allocation
UNALLOCATED_CACHE_BYTES = GIB
#: held-out records come from this index on: never part of any data set
HELD_OUT_INDEX = 2**48
#: the augmentation of the held-out set is that of this epoch, the same every time
HELD_OUT_EPOCH = 2**20

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)

UInt8Array = NDArray[np.uint8]
Float32Array = NDArray[np.float32]


def _splitmix(values: NDArray[np.uint64]) -> NDArray[np.uint64]:
    z = values + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _hash(seed: int, stream: int, counters: NDArray[np.uint64]) -> NDArray[np.uint64]:
    key = _splitmix(np.array([(seed * 1_000_003 + stream) % 2**64], dtype=np.uint64))
    return _splitmix(counters ^ key)


def raw_records(seed: int, indices: Sequence[int]) -> UInt8Array:
    """The raw bytes of records ``indices``, shaped (n, channels, size, size)."""
    base = np.asarray(indices, dtype=np.uint64)[:, None] * np.uint64(RECORD_BYTES)
    counters = base + np.arange(RECORD_BYTES, dtype=np.uint64)[None, :]
    raw = (_hash(seed, 0, counters) & np.uint64(0xFF)).astype(np.uint8)
    return raw.reshape(len(indices), RECORD_CHANNELS, RECORD_SIZE, RECORD_SIZE)


def _filter_pass(pixels: Tensor) -> Tensor:
    """One pass of the decoder's filter: sharpen, then smooth (in place of real codec
    work, with about its cost per pixel)."""
    smooth = functional.avg_pool2d(pixels, 3, stride=1, padding=1, count_include_pad=False)
    sharp = (2 * pixels - smooth).clamp_(0, 255)
    return functional.avg_pool2d(sharp, 3, stride=1, padding=1, count_include_pad=False)


def decode(raw: UInt8Array, passes: int) -> UInt8Array:
    """Decoded records: what a cache keeps."""
    if passes == 0:
        return raw
    pixels = torch.from_numpy(raw).float()
    for _ in range(passes):
        pixels = _filter_pass(pixels)
    return pixels.round_().to(torch.uint8).numpy()


def augment(
    decoded: UInt8Array, seed: int, epochs: Sequence[int], indices: Sequence[int], passes: int
) -> Float32Array:
    """Each record's augmentation in its epoch: crop, flip, brightness, ``passes`` filter
    passes, normalisation; shaped (n, channels, IMAGE_SIZE, IMAGE_SIZE)."""
    count = len(indices)
    epoch_keys = _splitmix(np.asarray(epochs, dtype=np.uint64))
    draws = _hash(seed, 1, epoch_keys ^ np.asarray(indices, dtype=np.uint64))
    room = RECORD_SIZE - IMAGE_SIZE + 1
    top = torch.from_numpy((draws % np.uint64(room)).astype(np.int64))
    left = torch.from_numpy(((draws >> np.uint64(8)) % np.uint64(room)).astype(np.int64))
    flip = torch.from_numpy(((draws >> np.uint64(16)) & np.uint64(1)).astype(bool))
    brightness = torch.from_numpy(
        0.8 + 0.4 * ((draws >> np.uint64(24)) % np.uint64(1024)).astype(np.float32) / 1023
    )
    steps = torch.arange(IMAGE_SIZE)
    rows = top[:, None] + steps[None, :]
    columns = left[:, None] + torch.where(flip[:, None], steps.flip(0), steps)
    pixels = torch.from_numpy(decoded).float()
    crop = pixels[
        torch.arange(count)[:, None, None, None],
        torch.arange(RECORD_CHANNELS)[None, :, None, None],
        rows[:, None, :, None],
        columns[:, None, None, :],
    ]
    crop = (crop * brightness[:, None, None, None]).clamp_(0, 255)
    for _ in range(passes):
        crop = _filter_pass(crop)
    return ((crop / 255.0 - 0.5) / 0.25).numpy()


@dataclass(frozen=True, slots=True)
class Chunk:
    """Samples for one worker: their records, epochs and, where a cache had them, their
    decoded records."""

    seed: int
    cost: CpuCost
    indices: tuple[int, ...]
    epochs: tuple[int, ...]
    decoded: tuple[UInt8Array | None, ...]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A chunk's model inputs, and the records it had to decode (None where cached)."""

    images: Float32Array
    decoded: tuple[UInt8Array | None, ...]


def prepare(chunk: Chunk) -> Prepared:
    """Decode what is not decoded yet and augment everything (in a worker or inline)."""
    shape = (RECORD_CHANNELS, RECORD_SIZE, RECORD_SIZE)
    records = np.empty((len(chunk.indices), *shape), dtype=np.uint8)
    missing = []
    for i, record in enumerate(chunk.decoded):
        if record is None:
            missing.append(i)
        else:
            records[i] = record
    fresh: list[UInt8Array | None] = [None] * len(chunk.indices)
    if missing:
        raw = raw_records(chunk.seed, [chunk.indices[i] for i in missing])
        records[missing] = decode(raw, chunk.cost.decode_passes)
        for i in missing:
            fresh[i] = records[i].copy()
    images = augment(records, chunk.seed, chunk.epochs, chunk.indices, chunk.cost.augment_passes)
    return Prepared(images, tuple(fresh))


def cache_budget_bytes(mem_gb: float | None, resident_bytes: float) -> int:
    """What a run's decoded-record cache may hold: its memory allocation less what the
    process holds besides the cache (a run without an allocation gets a fixed amount)."""
    if mem_gb is None:
        return UNALLOCATED_CACHE_BYTES
    return max(0, int(mem_gb * GIB - resident_bytes))


class DecodedCache:
    """Decoded records by index, never more than ``budget_bytes`` (entry overhead
    included). A full cache keeps what it has rather than evicting: reading the data set
    in a new order every epoch, any fixed part of it is hit as often as any other, and
    a cache that evicts to admit would only trade one record for another."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, budget_bytes)
        self.nbytes = 0
        self._records: dict[int, UInt8Array] = {}

    def __len__(self) -> int:
        return len(self._records)

    def get(self, index: int) -> UInt8Array | None:
        return self._records.get(index)

    def offer(self, index: int, record: UInt8Array) -> bool:
        """Keep ``record`` if it fits; True when it is (now) held."""
        if index in self._records:
            return True
        cost = record.nbytes + ENTRY_OVERHEAD_BYTES
        if self.nbytes + cost > self.budget_bytes:
            return False
        self._records[index] = record
        self.nbytes += cost
        return True

    def resize(self, budget_bytes: int) -> None:
        """A new bound; the most recently added records go first until it holds."""
        self.budget_bytes = max(0, budget_bytes)
        while self.nbytes > self.budget_bytes and self._records:
            _, record = self._records.popitem()
            self.nbytes -= record.nbytes + ENTRY_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class DataSet:
    """A job's records and the order it reads them in."""

    seed: int
    size: int = DEFAULT_DATASET_SIZE
    cost: CpuCost = field(default_factory=CpuCost)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")

    def locate(self, positions: Iterable[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(epoch, record index) of each position of the sample stream."""
        epochs: list[int] = []
        indices: list[int] = []
        orders: dict[int, tuple[int, int]] = {}
        for position in positions:
            epoch, offset = divmod(position, self.size)
            if epoch not in orders:
                orders[epoch] = self._order(epoch)
            stride, shift = orders[epoch]
            epochs.append(epoch)
            indices.append((stride * offset + shift) % self.size)
        return tuple(epochs), tuple(indices)

    def _order(self, epoch: int) -> tuple[int, int]:
        """The epoch's permutation ``offset -> (stride * offset + shift) mod size``: any
        stride prime to the size visits every record once, without a table."""
        draws = _hash(self.seed, 2, np.array([epoch, epoch + 2**62], dtype=np.uint64))
        stride, shift = (int(d) % self.size for d in draws)
        while math.gcd(stride, self.size) != 1:
            stride = (stride + 1) % self.size
        return stride, shift


def _serve(connection: Connection) -> None:
    """A worker: prepares the chunks it is sent until it is sent None."""
    # the run's stop signal goes to its whole process group: the training process
    # finishes its iteration with these workers, so they must not die of it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        # and they end with the training process, even when it is killed
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    torch.set_num_threads(1)
    with contextlib.suppress(EOFError, KeyboardInterrupt):
        while (chunk := connection.recv()) is not None:
            connection.send(prepare(chunk))


class Workers:
    """Worker processes, forked now (they inherit this process's cores), each on its own
    pipe: nothing is shared between them, so none can leave a lock held behind."""

    #: how long a worker told to end may take before it is killed
    END_WAIT_S = 5.0

    def __init__(self, count: int) -> None:
        context = multiprocessing.get_context("fork")
        self._connections: list[Connection] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        for _ in range(count):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs,), daemon=True)
            process.start()
            theirs.close()
            self._connections.append(ours)
            self._processes.append(process)

    def __len__(self) -> int:
        return len(self._processes)

    def send(self, chunks: Sequence[Chunk]) -> None:
        """One chunk to each of the first ``len(chunks)`` workers."""
        for connection, chunk in zip(self._connections, chunks, strict=False):
            connection.send(chunk)

    def receive(self, count: int) -> list[Prepared]:
        """The results of the last ``send`` of ``count`` chunks, in order."""
        results: list[Prepared] = [c.recv() for c in self._connections[:count]]
        return results

    def close(self) -> None:
        for connection in self._connections:
            with contextlib.suppress(OSError):
                connection.send(None)
        for process in self._processes:
            process.join(self.END_WAIT_S)
            if process.is_alive():
                process.kill()
                process.join()
        for connection in self._connections:
            connection.close()


@atexit.register
def _kill_workers() -> None:
    # multiprocessing's own exit handler (registered earlier, so run later) would stop
    # the workers with the SIGTERM they ignore and wait for them forever: a pipeline
    # not closed (the process is failing) loses its workers here instead
    for child in multiprocessing.active_children():
        child.kill()
        child.join()


def workers_for(cores: int) -> int:
    """Worker processes for a run on ``cores`` cores: one per core, none on one core
    (a worker there would only take turns with the training process)."""
    return cores if cores >= 2 else 0


def _split(count: int, parts: int) -> list[range]:
    bounds = [count * k // parts for k in range(parts + 1)]
    return [range(a, b) for a, b in itertools.pairwise(bounds) if b > a]


@dataclass
class _Pending:
    positions: range
    chunks: list[Chunk]


class InputPipeline:
    """Model inputs for runs of positions of a data set's sample stream, through a
    bounded cache of decoded records and ``workers`` processes (0: in this process)."""

    def __init__(self, data: DataSet, cache: DecodedCache, workers: int = 0) -> None:
        self.data = data
        self.cache = cache
        self.decoded = 0
        self._workers: Workers | None = None
        self._pending: _Pending | None = None
        self.set_workers(workers)

    @property
    def workers(self) -> int:
        return 0 if self._workers is None else len(self._workers)

    def set_workers(self, workers: int) -> None:
        """Run on ``workers`` processes from now on, started now: they inherit this
        process's cores."""
        if workers == self.workers:
            return
        self.close()
        if workers > 0:
            self._workers = Workers(workers)

    def images(self, positions: range) -> Tensor:
        """The inputs of ``positions``, shaped (n, channels, IMAGE_SIZE, IMAGE_SIZE)."""
        pending = self._receive_pending()
        if pending is not None and pending[0].positions == positions:
            chunks, prepared = pending[0].chunks, pending[1]
        else:
            chunks = self._chunks(positions)
            prepared = self._run(chunks)
        for chunk, result in zip(chunks, prepared, strict=True):
            for index, record in zip(chunk.indices, result.decoded, strict=True):
                if record is not None:
                    self.decoded += 1
                    self.cache.offer(index, record)
        return torch.from_numpy(np.concatenate([p.images for p in prepared]))

    def prefetch(self, positions: range) -> None:
        """Start preparing ``positions`` in the workers (nothing without workers)."""
        if self._workers is None or not positions:
            return
        self._receive_pending()
        chunks = self._chunks(positions)
        self._workers.send(chunks)
        self._pending = _Pending(positions, chunks)

    def close(self) -> None:
        """Stop the workers (a later batch is prepared in this process)."""
        self._receive_pending()
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def _chunks(self, positions: range) -> list[Chunk]:
        epochs, indices = self.data.locate(positions)
        decoded = tuple(self.cache.get(index) for index in indices)
        return [
            Chunk(self.data.seed, self.data.cost, indices[part.start : part.stop],
                  epochs[part.start : part.stop], decoded[part.start : part.stop])
            for part in _split(len(indices), max(1, self.workers))
        ]  # fmt: skip

    def _run(self, chunks: list[Chunk]) -> list[Prepared]:
        if self._workers is None:
            return [prepare(chunk) for chunk in chunks]
        self._workers.send(chunks)
        return self._workers.receive(len(chunks))

    def _receive_pending(self) -> tuple[_Pending, list[Prepared]] | None:
        """The prefetched batch, received (a worker sends nothing new before it is)."""
        pending, self._pending = self._pending, None
        if pending is None or self._workers is None:
            return None
        return pending, self._workers.receive(len(pending.chunks))


def held_out_images(data: DataSet, count: int) -> Tensor:
    """A held-out set: ``count`` records of no epoch's data, augmented the same way every
    time, prepared in this process."""
    indices = tuple(HELD_OUT_INDEX + i for i in range(count))
    chunk = Chunk(data.seed, data.cost, indices, (HELD_OUT_EPOCH,) * count, (None,) * count)
    return torch.from_numpy(prepare(chunk).images)
