"""How long a thread waits to take Python's lock back beside a busy main thread (issue 24).

tiered's dispatcher thread (tiered.runtime.dispatch) takes the GIL back after each ``mx.async_eval``
while the main thread builds the next layers in Python. Here a worker thread sleeps 0.3 ms in
a loop (the sleep releases the lock, as MLX's evaluation does) while the main thread runs
Python, per switch interval; printed: the median time past the same sleep on an idle thread.

    python bench/probes/gil_wait.py --intervals 0.005 0.0002 0.00005 0.00002
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np

SLEEP_S = 0.0003


def overshoot(busy: bool, seconds: float) -> float:
    """Median seconds a SLEEP_S sleep of a worker thread takes past SLEEP_S, with the main
    thread running Python (busy) or waiting."""
    stop, late = threading.Event(), []

    def worker():
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(SLEEP_S)
            late.append(time.perf_counter() - t - SLEEP_S)

    th = threading.Thread(target=worker)
    th.start()
    t0, x = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        if busy:
            for i in range(50):
                x += i
        else:
            time.sleep(0.01)
    stop.set()
    th.join()
    return float(np.median(late))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--intervals", type=float, nargs="+", default=[0.005, 0.0002, 0.00005, 0.00002])
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    before = sys.getswitchinterval()
    idle = overshoot(False, args.seconds)
    print(f"idle main thread: a {SLEEP_S * 1e6:.0f} us sleep wakes {idle * 1e6:.0f} us late")
    for iv in args.intervals:
        sys.setswitchinterval(iv)
        busy = overshoot(True, args.seconds)
        print(f"switch interval {iv * 1e6:7.0f} us, main thread running Python: "
              f"{(busy - idle) * 1e6:6.0f} us more")
    sys.setswitchinterval(before)


if __name__ == "__main__":
    main()
