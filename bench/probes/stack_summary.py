"""Summarize a py-spy ``--format raw`` profile (collapsed stacks): where the samples under one
function go (issue 24: the host side of a decode step, native frames included with --native).

    py-spy record --format raw --native -r 500 -o spy.txt -- \
        python bench/probes/device_eval_probe.py ...
    python bench/probes/stack_summary.py spy.txt --under time_decode
"""

from __future__ import annotations

import argparse
import collections
import re


def frame_name(frame: str, line: bool = False) -> str:
    """'Class.fn (path/file.py:12)' -> 'file.py:Class.fn' (':12' with line); native frames
    keep their symbol."""
    m = re.match(r"(.*) \((.*?)(:\d+)?\)$", frame)
    if not m:
        return frame
    fn, where, at = m.groups()
    return f"{where.split('/')[-1]}:{fn}{(at or '') if line else ''}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--under", default="", help="keep stacks with a frame containing this")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--lines", action="store_true",
                    help="inclusive counts per Python line (which call in a function costs)")
    args = ap.parse_args()
    self_n, py_n, incl_n, total = (collections.Counter(), collections.Counter(),
                                   collections.Counter(), 0)
    for line in open(args.file):
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        if args.under:
            at = next((i for i, f in enumerate(frames) if args.under in f), None)
            if at is None:
                continue
            frames = frames[at:]
        n = int(count)
        total += n
        names = [frame_name(f) for f in frames]
        self_n[names[-1]] += n
        py = [frame_name(f, True) for f in frames if ".py:" in f]  # native frames charged to their Python caller
        py_n[(py[-1] + "  <- " + py[-2]) if len(py) > 1 else (py or ["?"])[-1]] += n
        for name in set(names if not args.lines else
                        [frame_name(f, ".py:" in f) for f in frames]):
            incl_n[name] += n
    print(f"{total} samples under {args.under or 'everything'}")
    for title, counter in (("self (innermost frame)", self_n),
                           ("self by Python line's function, native time included", py_n),
                           ("inclusive", incl_n)):
        print(f"-- {title}")
        for name, n in counter.most_common(args.top):
            print(f"{100 * n / max(total, 1):6.1f}%  {name[:150]}")


if __name__ == "__main__":
    main()
