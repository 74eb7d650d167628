"""Where a process's memory goes while ``tiered run`` reads a long document (issue 61: does
``memory_budget`` bound the process?).

Runs the command in a child process and samples its /proc status every 50 ms: the peak of
anonymous memory (RssAnon: what the process allocated), of file-backed pages mapped into it
(RssFile: the model's weights file, the disk tier's page files) and of the whole RSS, each also
minus what the same model alone holds (a child that only loads it). Prints one line per figure.

    python bench/probes/rss_probe.py -- python -m tiered run --demo-tokens 32768 --seed 1 \\
        --gpu-budget 0.0625 --memory-budget 377487360 --disk-dir /tmp/rss
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def status(pid: int) -> dict[str, int] | None:
    """The fields above, in KiB, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    got = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in FIELDS:
            got[key] = int(rest.split()[0])
    return got


def watch(cmd: list[str], every: float = 0.05, phases: bool = False
          ) -> tuple[dict[str, int], int, str]:
    """Peaks (KiB) of the fields while ``cmd`` runs, its exit code and its output's tail.
    ``phases``: each line the command prints is followed by the peaks since its line before
    (where in the run the memory went: a layer of the prefill, the answer)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    peaks = dict.fromkeys(FIELDS, 0)
    since = dict.fromkeys(FIELDS, 0)  # peaks since the command's last line
    out = []
    import threading

    def read():
        for line in proc.stdout:
            out.append(line)
            if phases:
                print(line.rstrip()[:100] + "\n    since the line before: " + ", ".join(
                    f"{k} {since[k] / 1024:.1f}" for k in FIELDS) + " MiB", flush=True)
                since.update(dict.fromkeys(FIELDS, 0))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        now = status(proc.pid)
        if now:
            for k, v in now.items():
                peaks[k] = max(peaks[k], v)
                since[k] = max(since[k], v)
        time.sleep(every)
    reader.join(5)
    return peaks, proc.returncode, "".join(out[-40:])


MODEL_ONLY = ("import tiered, mlx.core as mx, time; m, t = tiered.load(); "
              "mx.eval(m.parameters()); time.sleep(1.0)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--phases", action="store_true",
                   help="print the peaks between each two lines the command prints")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command to watch")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the command after --")
    base, rc0, _ = watch([sys.executable, "-c", MODEL_ONLY])
    if rc0:
        raise SystemExit("the model alone failed to load")
    t = time.perf_counter()
    peaks, rc, tail = watch(cmd, phases=args.phases)
    print(tail)
    print(f"command: {' '.join(cmd)}\nexit {rc}, {time.perf_counter() - t:.0f} s")
    for k in FIELDS:
        print(f"peak {k:8s} {peaks[k] / 1024:9.1f} MiB; the model alone {base[k] / 1024:7.1f}; "
              f"above it {(peaks[k] - base[k]) / 1024:9.1f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
