"""Helper of bench/million.py: the device memory sampler, the disk steps' lines and the
memory plot."""

from __future__ import annotations

import threading

from common import figure, finish_axes, save_figure


class DeviceMemory:
    """Device memory in use (NVML), sampled in a thread; None where there is no NVIDIA GPU."""

    def __init__(self, interval=0.2):
        self.peak = self.base = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._h = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._read = lambda: pynvml.nvmlDeviceGetMemoryInfo(self._h).used
            self.base = self.peak = self._read()
        except Exception:
            return
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, args=(interval,), daemon=True)
        self._t.start()

    def _loop(self, interval):
        while not self._stop.wait(interval):
            self.peak = max(self.peak, self._read())

    def used(self):
        return None if self.base is None else self._read() - self.base

    def stop(self):
        if self.base is not None:
            self._stop.set()
            self._t.join()
            self.peak = max(self.peak, self._read())


def print_disk_steps(start: dict, steps: list, times: list) -> None:
    """One line per decode step where the worker copied disk rows: the token's ms, the device's
    wait for the worker, the worker's copying and polling, the layers whose export it found
    already waiting (late), the process's minor page faults."""
    if not steps or steps[-1][0]["layer_steps"] == start["layer_steps"]:
        return
    prev, faults = start, None
    for i, (c, f) in enumerate(steps):
        d = {k: c[k] - prev[k] for k in ("layer_steps", "device_wait_s", "copy_s", "poll_s",
                                         "late", "bytes", "rows", "copied_rows") if k in c}
        print(f"disk step {i}: {1e3 * times[i]:.1f} ms; device waiting "
              f"{1e3 * d.get('device_wait_s', 0):.1f} ms, worker copying {1e3 * d['copy_s']:.1f}"
              f" ms ({d['bytes'] / 2**20:.1f} MiB), polling {1e3 * d.get('poll_s', 0):.1f} ms, "
              f"late {d.get('late', 0)} of {d['layer_steps']}, rows copied "
              f"{d.get('copied_rows', 0)} of {d.get('rows', 0)} (the rest cached)"
              + (f", page faults minor {f[0] - faults[0]}, major {f[1] - faults[1]}"
                 if faults is not None else ""), flush=True)
        prev, faults = c, f


def plot(samples, args, path):
    x = [s["tokens"] for s in samples]
    fig, ax = figure(size=(7, 4))
    g = 2**30
    ax.plot(x, [s["rss"] / g for s in samples], label="host RSS (process)")
    ax.plot(x, [s["host"] / g for s in samples], label="host tier")
    ax.plot(x, [s["disk"] / g for s in samples], label="disk tier")
    ax.plot(x, [s["accelerator"] / g for s in samples], label="accelerator tier", lw=2)
    ax.plot(x, [s["budget"] / g for s in samples], "--", label="gpu budget")
    if samples and samples[0]["device"] is not None:
        ax.plot(x, [s["device"] / g for s in samples], label="device memory (NVML)")
    finish_axes(ax, xlabel="tokens prefilled", ylabel="GiB", logx=False,
                title=f"memory over a {args.tokens:,}-token prefill ({args.model})")
    save_figure(fig, path)
