"""MLX work still queued when a process exits or a cache closes (tiered.runtime.streams)."""

import subprocess
import sys

import pytest

from tiered.runtime import _platform, streams

import mlx.core as mx

THREADED_BLAS = _platform.BLAS.status in ("loaded", "already-loaded", "rebound")

# A chain of matmuls queued asynchronously, then the script ends: OpenBLAS's exit handler
# runs while a worker is inside the chain unless tiered waits for the stream first.
_SCRIPT = """
import sys
import tiered
import mlx.core as mx
a = mx.random.normal((2500, 2500))
mx.eval(a)
if sys.argv[1] == "generation":
    from mlx_lm.generate import generation_stream as stream
else:
    stream = mx.cpu
with mx.stream(stream):
    b = a @ a @ a @ a
mx.async_eval(b)
print("queued", tiered.runtime._platform.BLAS.status, flush=True)
"""


@pytest.mark.skipif(not THREADED_BLAS, reason="no threaded OpenBLAS serves MLX here")
@pytest.mark.parametrize("stream", ["default", "generation"])
def test_exit_with_a_queued_matmul_does_not_hang(stream):
    """Before tiered waited at exit this hung in OpenBLAS's blas_thread_shutdown_ every time
    (measured: 3 of 3 runs past a 30 s limit; mlx-lm's generate leaves such a pass queued)."""
    # -P: the script imports the installed tiered, not the source tree in the working directory
    r = subprocess.run([sys.executable, "-P", "-c", _SCRIPT, stream], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("queued")


def test_known_streams_include_mlx_lms_generation_stream():
    from mlx_lm.generate import generation_stream

    known = streams.known_streams()
    assert known[0] == mx.cpu
    assert any(s is generation_stream for s in known)
