"""Waiting for the work MLX still has queued: before a cache frees its host pages, and at exit.

mlx-lm's ``stream_generate`` queues one more forward pass than it returns (``generate_step``
evaluates token n+1 asynchronously while it yields token n), so when a caller stops after
``max_tokens`` that pass may still be running on MLX's stream thread:

- its kernels may still read a cache's host pages, so a host store waits for it before it
  frees them (``HostStore.close``: a cache's close, a trim to 0, a failed compression);
- on Linux, tiered loads Debian's threaded OpenBLAS (:mod:`tiered.runtime._platform`). Its exit
  handler (``blas_thread_shutdown_``, OpenBLAS 0.3.21) marks each worker to stop; a worker
  still inside a matmul then clears that mark when it finishes and sleeps for good, and the
  handler's ``pthread_join`` waits forever. A CLI run hung there in CI; a script that queues
  a matmul and exits hangs every time (``tests/test_streams.py``). So tiered waits for the
  streams at interpreter exit, before that handler runs.

MLX cannot list its streams: the ones waited for are the default stream of each device and
mlx-lm's generation stream. Work a caller queued on a stream of its own is theirs to wait for
(``mx.synchronize(stream)``).
"""

from __future__ import annotations

import sys


def known_streams() -> list:
    """The streams that may hold queued work tiered's callers started: each available device's
    default stream and, once mlx-lm's generate module is imported, its generation stream."""
    mx = sys.modules.get("mlx.core")
    if mx is None:
        return []
    out = [mx.cpu]
    if mx.is_available(mx.gpu):
        out.append(mx.gpu)
    generate = sys.modules.get("mlx_lm.generate")
    stream = getattr(generate, "generation_stream", None)
    if stream is not None:
        out.append(stream)
    return out


def drain() -> None:
    """Wait until the work queued on :func:`known_streams` has run."""
    mx = sys.modules.get("mlx.core")
    if mx is None:
        return
    for stream in known_streams():
        mx.synchronize(stream)


def drain_at_exit() -> None:
    """The interpreter-exit hook (:mod:`tiered.runtime._platform` registers it): :func:`drain`; a
    wait that fails is reported on stderr and the exit goes on."""
    try:
        drain()
    except Exception as e:  # noqa: BLE001 - reported; the exit must not stop here
        print(f"tiered: at exit, waiting for MLX's queued work failed: {e!r}", file=sys.stderr)
