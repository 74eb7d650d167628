"""Test cases run in a child process, so that a crash or a hang fails the case instead of
killing or stalling pytest.

``Child.call(timeout, fn, *args)`` runs ``fn(*args)`` (a module-level function, pickled by
reference) in a spawned Python process and returns its result. A segfault (the child exits)
or a call that runs past ``timeout`` seconds raises AssertionError, after the child is killed;
the next call starts a fresh one. The child lives across calls, so its imports and Numba's and
the Metal executor's compiled kernels are paid for once: give the first call of a test (a
warm-up on finite data, or the reference) a long timeout and the case itself a short one.
"""

from __future__ import annotations

import multiprocessing
import traceback

WARM_S = 600.0  # a fresh child imports mlx, numba and tiered, and may compile kernels


def _serve(conn):
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:
            return
        try:
            reply = ("ok", fn(*args))
        except BaseException:  # noqa: BLE001  (reported to the parent, which raises)
            reply = ("raised", traceback.format_exc())
        conn.send(reply)


class Child:
    """One spawned worker process, restarted after a crash or a hang."""

    def __init__(self):
        self._proc = None
        self._conn = None

    def _start(self):
        ctx = multiprocessing.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(theirs,), daemon=True)
        self._proc.start()
        theirs.close()

    def call(self, timeout: float, fn, *args):
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send((fn, args))
        # poll() also returns when the child dies (the pipe closes): recv() then raises.
        if not self._conn.poll(timeout):
            self.stop()
            raise AssertionError(f"{fn.__name__} did not finish within {timeout} s (hang)")
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            code = self._proc.exitcode
            self.stop()
            raise AssertionError(f"{fn.__name__} crashed the child process (exit code {code})")
        if status == "raised":
            raise AssertionError(f"{fn.__name__} raised in the child process:\n{value}")
        return value

    def stop(self):
        """Kill the child (if any); the next call starts a fresh one."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None
