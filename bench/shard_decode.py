"""One process against N ranks of a sharded cache (tiered.shard), on the embedded model's
pass-key demo: prefill and decode speed, each rank's positions, tiers and peak RSS.

    python bench/shard_decode.py --tokens 16384 --ranks 2 --budget 0.125

Runs ``tiered run --demo-tokens T --seed S --json`` in one process, then the same as N ranks of
MLX's ring backend (all on this machine: they share its cores; the ranks read the document in
turn, each its own shard), and writes results/sharded_cpu_embedded.md (each run replaces its
section). ``--one-json`` keeps the one-process run for a later call.

The ranks are started as ``mlx.launch`` starts them (a hostfile of local ports, MLX_RANK), not
by it: its forwarding loop selects on the ranks' stdin pipes, which are always writable, so it
never sleeps (mlx/_distributed_utils/launch.py); on this 2-core machine a 3k-token two-rank
prefill took 50 s under it and 25 s without. ``--launcher mlx.launch`` measures it anyway."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import common  # noqa: F401  (tiered before mlx)
from common import RESULTS, machine, md_table


def _run(cmd: list[str], env: dict | None = None) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)  # progress: stderr
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}): {r.stdout[-3000:]}")
    print(r.stdout[-1500:], file=sys.stderr)


def _ranks(cmd: list[str], ranks: int, tmp: str, env: dict | None) -> None:
    """``cmd`` as ``ranks`` ranks of the ring backend on this machine, as mlx.launch starts
    them (module docstring); rank 0's output shown as it runs (its progress), the others'
    on failure."""
    socks = [socket.socket() for _ in range(ranks)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    hosts = os.path.join(tmp, "hosts.json")
    with open(hosts, "w") as f:
        json.dump([[f"127.0.0.1:{s.getsockname()[1]}"] for s in socks], f)
    for s in socks:
        s.close()
    base = dict(os.environ if env is None else env, MLX_HOSTFILE=hosts)
    print("+ " + " ".join(cmd) + f"  (x{ranks} ranks)", file=sys.stderr, flush=True)
    logs = [None] + [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(1, ranks)]
    procs = [subprocess.Popen(cmd, env=dict(base, MLX_RANK=str(r)), stdout=logs[r],
                              stderr=subprocess.STDOUT if r else None) for r in range(ranks)]
    codes = [p.wait() for p in procs]
    outs = []
    for f in logs[1:]:
        f.seek(0)
        outs.append(f.read())
        f.close()
    if any(codes):
        raise SystemExit(f"ranks failed ({codes}): " + "".join(o[-2000:] for o in outs))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--budget", default="0.125")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=10)
    p.add_argument("--rank-threads", type=int, default=1,
                   help="BLAS / Numba / OpenMP threads per rank (0: the libraries' defaults; "
                        "ranks with a pool each oversubscribe the cores they share)")
    p.add_argument("--launcher", choices=["direct", "mlx.launch"], default="direct")
    p.add_argument("--one-json", default=None,
                   help="the one-process run's --json: read where it exists (a run made before, "
                        "same tokens, seed and budget), else written there")
    a = p.parse_args()
    demo = ["-m", "tiered", "run", "--demo-tokens", str(a.tokens), "--seed", str(a.seed),
            "--gpu-budget", a.budget, "--max-tokens", str(a.max_tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        one_json, many_json = os.path.join(tmp, "one.json"), os.path.join(tmp, "many.json")
        reused = bool(a.one_json and os.path.exists(a.one_json))
        if reused:
            one_json = a.one_json
        else:
            one_json = a.one_json or one_json
            _run([sys.executable, *demo, "--json", one_json])
        env = None if not a.rank_threads else dict(
            os.environ, **{v: str(a.rank_threads) for v in
                           ("OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS")})
        if a.launcher == "mlx.launch":
            _run([shutil.which("mlx.launch"), "-n", str(a.ranks), "--backend", "ring",
                  "--python", sys.executable, *demo, "--json", many_json], env)
        else:
            _ranks([sys.executable, *demo, "--json", many_json], a.ranks, tmp, env)
        one, many = json.load(open(one_json)), json.load(open(many_json))
    b = one["bytes"]
    rows = [["1 process", f"{one['prefill']['tokens_per_s']:,.1f}",
             f"{1000 / one['generation_tps']:,.1f}", one["tokens"],
             f"{b['accelerator'] / 2**20:.1f}", f"{b['host'] / 2**20:.1f}",
             f"{b['disk'] / 2**20:.1f}", f"{one['peak_rss_bytes'] / 2**30:.2f}",
             "found" if a_found(one) else "NOT found"]]
    n_doc = one["prefill"]["tokens"]
    for r in many["ranks"]:
        rb = r["bytes"]
        rows.append([f"rank {r['rank']} of {a.ranks}", f"{n_doc / many['prefill_s']:,.1f}",
                     f"{1000 / many['generation_tps']:,.1f}", r["held_tokens"],
                     f"{rb['accelerator'] / 2**20:.1f}", f"{rb['host'] / 2**20:.1f}",
                     f"{rb['disk'] / 2**20:.1f}", f"{r['peak_rss_bytes'] / 2**30:.2f}",
                     "found" if many["found"] else "NOT found"])
    table = md_table(["run", "prefill tok/s", "decode ms/token", "positions held",
                      "accelerator MiB", "host MiB", "disk MiB", "peak RSS GiB", "pass key"],
                     rows)
    info = machine()
    kept = f"; its run read from {a.one_json}, made before" if reused else ""
    threads = (f"{a.rank_threads} BLAS/Numba thread(s) per rank" if a.rank_threads
               else "the libraries' default threads per rank")
    threads += (", started by mlx.launch" if a.launcher == "mlx.launch" else
                ", started as mlx.launch starts them, without its launcher process")
    section = (f"## {a.tokens} tokens, gpu_budget {a.budget}, {a.ranks} ranks\n\n"
               f"`{info['command']}` at {info['commit']} ({info['platform']}, "
               f"{info['cpu_count']} cores, MLX {info['versions']['mlx']}, float32 on the CPU "
               f"backend; the ranks share the machine's cores, {threads}; the one process "
               f"keeps the default threads{kept})\n\n{table}\n")
    path = os.path.join(RESULTS, "sharded_cpu_embedded.md")
    head = ("# A sharded cache over ranks on one CPU machine (bench/shard_decode.py)\n\n"
            "Every rank runs the whole model on the same tokens (weights replicated) and holds "
            "its part of the document's positions; decode ms/token is 1000 / mlx-lm's "
            "generation tok/s of the answer's tokens.\n\n")
    old = open(path).read() if os.path.exists(path) else head
    parts = old.split("\n## ")
    kept = [x for x in parts[1:] if not x.startswith(section.split("\n")[0][3:])]
    with open(path, "w") as f:
        f.write(parts[0].rstrip() + "\n\n" + "".join("## " + x.rstrip() + "\n\n" for x in kept)
                + section)
    print(table)
    return 0


def a_found(rep: dict) -> bool:
    return rep.get("expected") is not None and str(rep["expected"]) in rep.get("answer", "")


if __name__ == "__main__":
    sys.exit(main())
