"""When a cold machine's first 1M-token run compiles, and what its main thread waits for.

Runs ``million.py`` with its arguments, logging (seconds since start, thread) each compile of
tiered's PTX cache (:mod:`tiered.metal.ptx_cache`) and of MLX's modules made ahead
(:mod:`tiered.metal.mlx_warm`) as it starts and ends, and each ``ptx_cache.settle`` that waits
(how many compiles pending, when done) to ``$OUT/compile_log.txt``; and samples the main
thread's innermost frames every 0.5 s for ``SAMPLE_S`` seconds (default 120) to
``$OUT/stacks.txt``. On the accelerator machine, a fresh one (``bash bench/gpu_session.sh
cold``, after staging and installing):

    cd bench && python3 probes/compile_timeline.py --model llama3-8b --tokens-file \\
        /tmp/stage/million_tokens.npz --host-budget 80GB --no-host-keys --disk-dir /tmp/pages \\
        --decode-steps 4 --name million_cold
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path

T0 = time.time()
OUT = Path(os.environ.get("OUT", "/tmp/out"))
OUT.mkdir(parents=True, exist_ok=True)
_log = open(OUT / "compile_log.txt", "w", buffering=1)


def log(*what) -> None:
    name = threading.current_thread().name[:14]
    _log.write(f"{time.time() - T0:8.3f} {name:14s} " + " ".join(map(str, what)) + "\n")


def _wrap(module, attr: str, label) -> None:
    inner = getattr(module, attr)

    def timed(*args):
        what = label(*args)
        log(what, "start")
        out = inner(*args)
        log(what, "end", out if isinstance(out, bool) else "")
        return out

    setattr(module, attr, timed)


def _sample(main: threading.Thread, seconds: float) -> None:
    with open(OUT / "stacks.txt", "w", buffering=1) as f:
        while time.time() - T0 < seconds:
            time.sleep(0.5)
            frame = sys._current_frames().get(main.ident)
            if frame is not None:
                inner = reversed(traceback.extract_stack(frame)[-9:])
                f.write(f"{time.time() - T0:8.3f} " + " < ".join(
                    f"{Path(s.filename).name}:{s.name}:{s.lineno}" for s in inner) + "\n")


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, million
    import common  # noqa: F401  (tiered before mlx)
    import million
    from tiered.metal import mlx_warm, ptx_cache

    _wrap(ptx_cache, "_write", lambda text, module, *a: f"tiered compile {module[:70]}")
    _wrap(mlx_warm, "_make", lambda name, *a: f"mlx_warm {name[:70]}")
    settle = ptx_cache.settle

    def waited():
        n = len(ptx_cache._pending)
        if n:
            log("settle wait", n)
        settle()
        if n:
            log("settle done")

    ptx_cache.settle = waited
    threading.Thread(target=_sample, args=(threading.main_thread(),
                                           float(os.environ.get("SAMPLE_S", "120"))),
                     daemon=True, name="sampler").start()
    log("million start")
    million.main(sys.argv[1:])
    log("million end")


if __name__ == "__main__":
    main()
