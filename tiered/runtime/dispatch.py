"""A second thread hands a decode step's layers to the accelerator (issue 24).

On an H200 a token's host time is two parts of about equal size, run one after the other on
the main thread: Python building each layer's graph (mlx-lm's layer, tiered's append and
step), and MLX dispatching it inside ``mx.async_eval`` (each primitive's ``eval_gpu``,
encoding kernels into CUDA graphs; ~15 of 37 ms per token at 1M tokens, bench/million.py
--step-timers). MLX releases the GIL while it dispatches, so here a daemon thread
("tiered-dispatch") runs those ``mx.async_eval`` calls while the main thread builds the next
layers: the two parts overlap.

What makes that safe:

- **A shared stream.** MLX 0.32 gives every thread its own GPU streams; a thread cannot
  evaluate arrays made on another thread's stream ("There is no Stream(gpu, n) in current
  thread"). :func:`stream` is one ``mx.new_thread_unsafe_stream`` per process;
  :func:`tiered.runtime.integration.install` makes it mlx-lm's generation stream. Steps built on any
  other stream are dispatched on the main thread as before.
- **One thread encodes at a time.** A thread-unsafe stream has one command encoder, so every
  evaluation in tiered goes through :func:`eval` / :func:`async_eval` here, which wait for the
  dispatcher to finish (:func:`drain`) first, and the last layer of a step drains before
  mlx-lm reads the token (:meth:`tiered.cache.TieredCache.attention`); so does a failed step.
- **Errors reach the caller.** An error raised on the dispatcher is raised by the next
  :func:`drain`; an array it could not evaluate because it was made on a thread-local stream
  is evaluated on the main thread instead, and the dispatcher is turned off for the process.

``TIERED_DISPATCH_THREAD=0`` turns it off (every hand-off on the main thread, as before).
Turn it off too where several threads of one process run models at the same time: mlx-lm
gives each thread its own generation stream, and here they would share one.
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import sys
import threading
import time

import mlx.core as mx
from mlx.utils import tree_flatten

from ..metal import ptx_cache

log = logging.getLogger("tiered")

# While the dispatcher runs, Python hands the GIL to a waiting thread after this long (the
# default 5 ms would hold each hand-off back by up to that much while the main thread runs
# Python). The thread takes the GIL back after each mx.async_eval while the main thread
# builds: a wait of about the interval each time (bench/probes/gil_wait.py on a 2-core Linux host:
# ~270 us more than an idle thread's wake at 0.2 ms, ~80 us at 0.02 ms), and a token's 16
# hand-offs fell behind the building. H200, 128k, three rounds each in one process
# (bench/probes/device_probe.py --toggle tiered.runtime.dispatch.SWITCH_INTERVAL_S=0.0002,0.00002):
# 25.43 / 25.99 / 25.52 -> 23.85 / 23.83 / 23.43 ms/token, the main thread's wait for the
# dispatcher 6.4-7.7 -> 3.1-6.8 ms.
SWITCH_INTERVAL_S = float(os.environ.get("TIERED_DISPATCH_SWITCH_S", "0.00002"))

_enabled = os.environ.get("TIERED_DISPATCH_THREAD", "1") not in ("0", "false", "no", "off")
_stream: mx.Stream | None = None
_lock = threading.Lock()


def enabled() -> bool:
    return _enabled


def stream() -> mx.Stream | None:
    """The process's shared (thread-unsafe) stream on the default device; None where the
    dispatcher is off or there is no accelerator."""
    global _stream
    if _stream is None and _enabled and _cuda():
        with _lock:
            if _stream is None:
                _stream = mx.new_thread_unsafe_stream(mx.default_device())
    return _stream


def _cuda() -> bool:
    # CUDA only: Metal's streams were never measured with a second thread encoding
    cuda = getattr(mx, "cuda", None)
    return (cuda is not None and cuda.is_available()
            and mx.default_device().type == mx.DeviceType.gpu)


def on_shared_stream() -> bool:
    """Whether the ops being built now go to the shared stream (a step the dispatcher may
    take)."""
    return (_enabled and _stream is not None
            and mx.default_stream(mx.default_device()) == _stream)


def adopt_stream(*arrays) -> bool:
    """A step starting on a thread whose default stream is not the shared one (a model run
    from a thread other than the one that made the cache, outside mlx-lm's generate): what
    the step built so far (``arrays``, on this thread's own stream, which no other thread can
    evaluate: the dispatcher, a save) is evaluated here, and the shared stream becomes this
    thread's default. True when it switched."""
    s = _stream
    if s is None or not _enabled or mx.default_stream(mx.default_device()) == s:
        return False
    mx.eval(*arrays)
    mx.set_default_stream(s)
    return True


def share_streams() -> bool:
    """Build on the shared stream from now on: the calling thread's default stream and
    mlx-lm's generation stream (``generate`` and ``stream_generate`` run the model inside
    ``mx.stream(generation_stream)``, a stream local to each thread). False (nothing changed)
    where the dispatcher is off or there is no CUDA device."""
    s = stream()
    if s is None:
        return False
    mx.set_default_stream(s)
    gen = importlib.import_module("mlx_lm.generate")  # mlx_lm.generate is also a function

    old = gen.generation_stream
    if old is not s:
        for fn in vars(gen).values():  # defaults bound when mlx-lm was imported
            if callable(fn) and getattr(fn, "__defaults__", None):
                if any(d is old for d in fn.__defaults__):
                    fn.__defaults__ = tuple(s if d is old else d for d in fn.__defaults__)
        gen.generation_stream = s
    return True


# The worker in C++ where tiered's native module runs (TIERED_NATIVE=1 on CUDA,
# tiered.metal.native): it never takes the GIL, so the main thread keeps Python's default switch
# interval and is not made to hand the GIL over while it builds (metal/native_dispatch.cpp).
NATIVE = True


class _Ticket:
    """What :meth:`Dispatcher.submit` returns on the native worker: the submission's number."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n


class Dispatcher:
    """One worker thread that runs ``mx.async_eval`` on what it is handed, in order."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._queued = 0
        self._error: BaseException | None = None
        self._left: list = []  # what it could not evaluate, for the main thread
        self._thread: threading.Thread | None = None
        self._busy_py = 0.0
        self._native = None  # the C++ worker (metal/native_dispatch.cpp), once chosen
        self._native_checked = False
        self.wait_s = 0.0  # seconds the main thread waited for it in drain

    @property
    def busy_s(self) -> float:
        """Seconds the worker spent handing graphs over (bench/dispatch_probe)."""
        return self._busy_py + (self._native.busy_s() if self._native is not None else 0.0)

    @property
    def busy(self) -> bool:
        return self._queued > 0 or (self._native is not None and self._native.queued() > 0)

    def native(self):
        """The C++ worker where it runs (decided once), else None."""
        if not self._native_checked:
            self._native_checked = True
            if NATIVE:
                from ..metal import native

                mod = native.cuda()
                self._native = mod.Dispatch() if mod is not None else None
        return self._native

    def submit(self, arrays: list):
        """Queue ``mx.async_eval(*arrays)`` on the worker; returns what :meth:`wait_handed`
        and :meth:`handed` take (a threading.Event, set once it ran, or a native ticket)."""
        ptx_cache.settle()  # the kernels it launches compiled (side by side) first
        nd = self.native()
        if nd is not None:
            return _Ticket(nd.submit(arrays))
        with self._cv:
            if self._thread is None or not self._thread.is_alive():
                if sys.getswitchinterval() > SWITCH_INTERVAL_S:
                    sys.setswitchinterval(SWITCH_INTERVAL_S)
                self._thread = threading.Thread(target=self._run, name="tiered-dispatch",
                                                daemon=True)
                self._thread.start()
            self._queued += 1
        done = threading.Event()
        self._q.put((arrays, done))
        return done

    def wait_handed(self, done) -> None:
        """Wait until one submission was handed to the device (not the ones queued after it):
        its arrays are scheduled then, and reading them only waits for the device."""
        if isinstance(done, _Ticket):
            if self._native is None:  # the worker was switched off, drained first
                return
            self.wait_s += self._native.wait(done.n)
            if self._native.failed():
                self.drain()
            return
        done.wait()
        if self._error is not None or self._left:
            self.drain()  # raise what failed, or evaluate what it handed back

    def handed(self, done: threading.Event | None) -> bool:
        """Whether the submission that returned ``done`` was handed to the device without
        error: its arrays are scheduled, and reading one waits only for the device
        (``array::eval`` of a scheduled array waits for its event and encodes nothing), not
        for the submissions queued after it (:meth:`drain`)."""
        if isinstance(done, _Ticket):
            if self._native is None:  # the worker was switched off, drained first
                return self._error is None and not self._left
            return (self._native.handed(done.n) and not self._native.failed()
                    and self._error is None and not self._left)
        return done is not None and done.is_set() and self._error is None and not self._left

    def drain(self) -> None:
        """Wait until everything submitted was handed to the device; raise what the worker
        raised. Arrays it could not take are evaluated here (asynchronously)."""
        global _enabled
        nd = self._native
        if nd is not None and (nd.queued() or nd.failed()):
            self.wait_s += nd.wait(0)
            kind, what, left = nd.take()
            self._left += left
            if kind and self._error is None:
                self._error = (ValueError if kind == "value" else RuntimeError)(what)
        if not (self._queued or self._left or self._error is not None):
            return
        if self._queued:
            t = time.perf_counter()
            with self._cv:
                while self._queued:
                    self._cv.wait()
            self.wait_s += time.perf_counter() - t
        left, self._left = self._left, []
        if left:
            _enabled = False
            log.warning("tiered: decode steps built on a thread-local MLX stream: handed to the "
                        "device on the main thread from now on")
            mx.async_eval(*left)
        err, self._error = self._error, None
        if err is not None:
            raise err

    def _run(self):
        while True:
            arrays, done = self._q.get()
            try:
                if self._left:  # the main thread takes the rest of the step (see drain)
                    self._left += arrays
                elif self._error is None:  # after an error the step fails: nothing more
                    t = time.perf_counter()
                    mx.async_eval(*arrays)
                    self._busy_py += time.perf_counter() - t
            except RuntimeError as e:
                if "in current thread" in str(e):  # made on another thread's stream
                    self._left += arrays
                else:
                    self._error = e
            except BaseException as e:  # raised by the main thread's next drain
                self._error = e
            finally:
                with self._cv:
                    self._queued -= 1
                    self._cv.notify_all()
                done.set()


DISPATCHER = Dispatcher()


def submit(*arrays) -> threading.Event:
    return DISPATCHER.submit(list(arrays))


def wait_handed(done: threading.Event) -> None:
    DISPATCHER.wait_handed(done)


def wait_for(done) -> None:
    """Wait (on any thread) until the submission that returned ``done`` ran; unlike
    :func:`wait_handed` nothing is raised or taken over here."""
    if isinstance(done, _Ticket):
        nd = DISPATCHER._native
        if nd is not None:
            nd.wait(done.n)
    elif done is not None:
        done.wait()


def handed(done: threading.Event | None) -> bool:
    return DISPATCHER.handed(done)


def drain() -> None:
    """Nothing of tiered's is being dispatched on another thread after this returns."""
    DISPATCHER.drain()


def drain_quietly() -> None:
    """:func:`drain` where an error is being raised already (the dispatcher's own is dropped:
    the step fails with the first)."""
    try:
        drain()
    except BaseException as e:  # noqa: BLE001
        log.warning("tiered: the dispatcher also failed: %r", e)


def eval_held(caches) -> None:
    """Evaluate, on this thread, what the layers of a rolled-back step hold (a TieredCache's
    ``lazy_arrays`` without flushing, another cache's ``state``). MLX streams are per thread:
    what the failed step and its roll-back left lazy is on the failing thread's stream, which
    no other thread can evaluate ("There is no Stream(cpu, 1) in current thread"), and the
    cache would be unusable from every other thread. Errors here are logged: the step's own
    is being raised."""
    arrays = []
    for c in caches:
        if getattr(c, "closed", False):
            continue
        try:
            if hasattr(c, "lazy_arrays"):
                arrays += c.lazy_arrays(door=False, flush=False)
            else:
                arrays += [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
        except Exception as e:  # noqa: BLE001
            log.warning("tiered: layer %s: rolling back a failed step: %r",
                        getattr(c, "layer", "?"), e)
    try:
        eval(*arrays)
    except Exception as e:  # noqa: BLE001
        log.warning("tiered: rolling back a failed step: %r", e)


def eval(*arrays) -> None:  # noqa: A001  (mx.eval's drop-in)
    drain()
    ptx_cache.settle()
    mx.eval(*arrays)


def async_eval(*arrays) -> None:
    drain()
    ptx_cache.settle()
    mx.async_eval(*arrays)
