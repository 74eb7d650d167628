"""A sampling line profiler for the decode step's host time (issue 24).

cProfile and per-call timers slow every Python call and cannot see which line waits inside an
MLX call; this samples the main thread's stack from a second thread every ``interval`` seconds
(the GIL is handed over at least that often: ``sys.setswitchinterval``), so a line's share of
samples is its share of wall time, MLX calls included (attributed to the line that made them).

    with LineSampler() as s:
        ...  # decode steps
    s.report(per=steps, wall=seconds)
"""

from __future__ import annotations

import collections
import sys
import threading
import time


class LineSampler:
    def __init__(self, interval: float = 1e-4, keep=("tiered", "mlx_lm", "bench")):
        self.interval, self.keep = interval, keep
        self.lines = collections.Counter()  # innermost frame of ours: (file, line, function)
        self.funcs = collections.Counter()  # every function of ours on the stack (inclusive)
        self.samples = 0

    def _ours(self, filename: str) -> bool:
        return any(f"/{k}/" in filename for k in self.keep)

    def _run(self, target: int):
        while not self._stop.is_set():
            frame = sys._current_frames().get(target)
            if frame is not None:
                self.samples += 1
                leaf, seen = None, set()
                f = frame
                while f is not None:
                    code = f.f_code
                    if self._ours(code.co_filename):
                        if leaf is None:
                            leaf = (code.co_filename.split("/")[-1], f.f_lineno, code.co_name)
                        key = (code.co_filename.split("/")[-1], code.co_name)
                        if key not in seen:
                            seen.add(key)
                            self.funcs[key] += 1
                    f = f.f_back
                self.lines[leaf or ("(other)", 0, "")] += 1
            time.sleep(self.interval)

    def __enter__(self):
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval / 2)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(threading.get_ident(),), daemon=True)
        self._t0 = time.perf_counter()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.wall = time.perf_counter() - self._t0
        sys.setswitchinterval(self._switch)

    def report(self, per: int = 1, top: int = 40, file=None):
        """Lines and functions by share of samples, as ms per ``per`` (e.g. per token)."""
        ms = 1e3 * self.wall / max(self.samples, 1) / per
        print(f"{self.samples} samples over {self.wall:.2f} s; ms per unit = samples x "
              f"{ms:.4f}", file=file)
        print("  lines (innermost of ours):", file=file)
        for (fn, line, name), c in self.lines.most_common(top):
            print(f"    {c * ms:8.3f} ms  {100 * c / self.samples:5.1f}%  {fn}:{line} {name}",
                  file=file)
        print("  functions (inclusive):", file=file)
        for (fn, name), c in self.funcs.most_common(top):
            print(f"    {c * ms:8.3f} ms  {100 * c / self.samples:5.1f}%  {fn}:{name}", file=file)
