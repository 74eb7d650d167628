"""Worker pool for CPU jobs (Numba ``nogil`` kernels) that run beside accelerator work.

A job is split by KV head across the workers; the caller keeps working (the accelerator's
partial) and then waits. Every job and every wait is timed as an interval, so the overlap ratio
is measured, not assumed:

    overlap = CPU time hidden / CPU time

where "CPU time" is the wall time during which at least one job of the batch was running (the
union of the job intervals) and "hidden" is the part of it outside the caller's wait. Summing
job durations instead would credit eight workers busy for 1 ms during a 1 ms wait with 7 ms
hidden; with intervals that batch hides nothing. The summed durations are kept as ``cpu_busy``.

A worker's exception is re-raised in the caller by :meth:`Batch.wait`; nothing hangs: jobs
have no inter-dependencies, and :meth:`Scheduler.close` joins every thread. A job that never
ends (a hang in a kernel or a read) does not hang the caller: a wait gives up after
``TIERED_GATHER_TIMEOUT`` seconds (default 300; 0 or "none": no limit) with a TimeoutError
naming the layer, and the scheduler leaves that job's threads behind for fresh ones.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

TIMEOUT_ENV = "TIERED_GATHER_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


def job_timeout() -> float | None:
    """Seconds a wait on CPU jobs may last (``TIERED_GATHER_TIMEOUT``; None: no limit)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip().lower()
    if raw in ("", "default"):
        return DEFAULT_TIMEOUT_S
    if raw in ("0", "none", "off", "inf"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"Invalid {TIMEOUT_ENV}={raw!r}: expected seconds (> 0) or 'none'")
    return value


def union_length(intervals) -> float:
    """Total length covered by (start, end) intervals (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def clip_intervals(intervals, lo: float, hi: float) -> list:
    """The parts of the intervals that fall inside [lo, hi]."""
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


@dataclass
class Timings:
    """Per-scheduler totals, and per (layer) lists of per-step figures, in seconds."""

    cpu_busy: float = 0.0  # sum of job run times (all workers)
    cpu_wall: float = 0.0  # wall time with at least one job running (union of job intervals)
    hidden: float = 0.0  # the part of cpu_wall outside the caller's waits
    waited: float = 0.0  # time callers spent blocked on jobs
    accelerator: float = 0.0  # time callers spent on the accelerator partial meanwhile
    jobs: int = 0
    per_layer: dict = field(default_factory=dict)  # layer -> {"cpu": [...], "cpu_wall": [...], "wait": [...], "accel": [...]}

    @property
    def overlap_ratio(self) -> float | None:
        """CPU time hidden behind the caller's own work / CPU time (both as wall time)."""
        if self.cpu_wall <= 0:
            return None
        return max(0.0, min(1.0, self.hidden / self.cpu_wall))

    def summary(self) -> dict:
        return {
            "jobs": self.jobs,
            "cpu_busy_s": self.cpu_busy,
            "cpu_wall_s": self.cpu_wall,
            "hidden_s": self.hidden,
            "waited_s": self.waited,
            "accelerator_s": self.accelerator,
            "overlap_ratio": self.overlap_ratio,
        }


class Batch:
    """Jobs of one step of one layer. ``wait()`` returns their results in submission order."""

    def __init__(self, scheduler: "Scheduler", layer: int):
        self.scheduler, self.layer = scheduler, layer
        self.futures: list[Future] = []
        self.intervals: list[tuple[float, float]] = []  # (start, end) of each job run
        self.inline: list[tuple[float, float]] = []  # runs in the caller's thread (never hidden)
        self._lock = threading.Lock()

    def submit(self, fn, *args):
        inline = self.scheduler.workers == 0

        def run():
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                span = (t, time.perf_counter())
                with self._lock:
                    self.intervals.append(span)
                    if inline:
                        self.inline.append(span)

        if inline:
            # Inline mode (workers=0 is never user-facing; used by tests as a reference).
            f = Future()
            try:
                f.set_result(run())
            except BaseException as e:  # noqa: BLE001 - re-raised by wait()
                f.set_exception(e)
            self.futures.append(f)
            return f
        f = self.scheduler._executor().submit(run)
        self.futures.append(f)
        return f

    def wait(self, accelerator_seconds: float = 0.0):
        """The jobs' results in submission order; a job's exception is raised here, and a
        TimeoutError naming the layer when they take longer than the scheduler's timeout."""
        t = time.perf_counter()
        limit = self.scheduler.timeout
        try:
            results = []
            for f in self.futures:
                left = None if limit is None else max(0.0, t + limit - time.perf_counter())
                try:
                    results.append(f.result(left))
                except FutureTimeout:
                    for g in self.futures:
                        g.cancel()  # those not started yet
                    self.scheduler._abandon()
                    raise TimeoutError(
                        f"layer {self.layer}: a CPU job (gather of host pages) still runs after "
                        f"{limit:g} s ({TIMEOUT_ENV}); the step is not applied, and its worker "
                        "thread is left behind (later steps run on fresh ones)") from None
        finally:
            end = time.perf_counter()
            with self._lock:
                spans = list(self.intervals)
                inline = list(self.inline)
            wall = union_length(spans)
            # Exposed: job time inside the wait, plus inline jobs (the caller ran them itself).
            exposed = union_length(inline + clip_intervals(spans, t, end))
            busy = sum(b - a for a, b in spans)
            waited = (end - t) + sum(b - a for a, b in inline)
            self.scheduler._record(self.layer, busy, wall, max(0.0, wall - exposed), waited,
                                   accelerator_seconds, len(self.futures))
        return results


class Scheduler:
    """A pool of ``workers`` threads for CPU jobs, with timing of what it overlapped."""

    def __init__(self, workers: int = 2, *, record_steps: bool = True,
                 timeout: float | None | str = "env"):
        if not isinstance(workers, int) or workers < 0:
            raise ValueError(f"Invalid workers: {workers!r} (expected an integer >= 1)")
        self.workers = workers
        self.record_steps = record_steps
        # seconds a Batch.wait may last (None: no limit); "env": TIERED_GATHER_TIMEOUT
        self.timeout = job_timeout() if timeout == "env" else timeout
        self.timings = Timings()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, Scheduler._shutdown, [None])

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("this Scheduler is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="tiered-cpu")
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, Scheduler._shutdown, [self._pool])
            return self._pool

    def _abandon(self) -> None:
        """Leave the current threads to a job that hangs: later jobs get a fresh pool (the
        stuck thread still holds the interpreter's exit until its job ends: Python joins
        every worker thread then)."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, Scheduler._shutdown, [None])
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def batch(self, layer: int = -1) -> Batch:
        return Batch(self, layer)

    def _record(self, layer, busy, wall, hidden, waited, accel, jobs):
        with self._lock:
            t = self.timings
            t.cpu_busy += busy
            t.cpu_wall += wall
            t.hidden += hidden
            t.waited += waited
            t.accelerator += accel
            t.jobs += jobs
            if self.record_steps:
                d = t.per_layer.setdefault(layer, {"cpu": [], "cpu_wall": [], "wait": [],
                                                   "accel": []})
                d["cpu"].append(busy)
                d["cpu_wall"].append(wall)
                d["wait"].append(waited)
                d["accel"].append(accel)

    def reset_timings(self):
        with self._lock:
            self.timings = Timings()

    @staticmethod
    def _shutdown(box):
        pool = box[0] if isinstance(box, list) else box
        if pool is not None:
            pool.shutdown(wait=True)

    def close(self):
        """Finish running jobs and join every worker thread. Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_default: Scheduler | None = None
_default_lock = threading.Lock()


def default_scheduler(workers: int = 2) -> Scheduler:
    """A process-wide scheduler for caches that were not given one (e.g. loaded from disk)."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = Scheduler(workers)
        return _default


def split_heads(n_heads: int, workers: int) -> list[range]:
    """Contiguous KV-head ranges, one per worker (fewer when there are fewer heads)."""
    w = max(1, min(workers, n_heads))
    bounds = [round(i * n_heads / w) for i in range(w + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(w) if bounds[i + 1] > bounds[i]]
