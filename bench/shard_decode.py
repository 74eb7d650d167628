"""One process against N ranks of a sharded cache (tiered.shard), on the embedded model's
pass-key demo: prefill and decode speed, each rank's positions, tiers and peak RSS.

    python bench/shard_decode.py --tokens 16384 --ranks 2 --budget 0.125

Runs ``tiered run --demo-tokens T --seed S --json`` in one process, then the same under
``mlx.launch -n N --backend ring`` (all ranks on this machine: they share its cores), and writes
results/sharded_cpu_embedded.md (each run replaces its section)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import common  # noqa: F401  (tiered before mlx)
from common import RESULTS, machine, md_table


def _run(cmd: list[str], env: dict | None = None) -> None:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}): {r.stderr[-3000:]}")
    print(r.stdout[-1500:], file=sys.stderr)


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
    a = p.parse_args()
    demo = ["-m", "tiered", "run", "--demo-tokens", str(a.tokens), "--seed", str(a.seed),
            "--gpu-budget", a.budget, "--max-tokens", str(a.max_tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        one_json, many_json = os.path.join(tmp, "one.json"), os.path.join(tmp, "many.json")
        _run([sys.executable, *demo, "--json", one_json])
        env = None if not a.rank_threads else dict(
            os.environ, **{v: str(a.rank_threads) for v in
                           ("OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS")})
        _run([shutil.which("mlx.launch"), "-n", str(a.ranks), "--backend", "ring", "--python",
              sys.executable, *demo, "--json", many_json], env)
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
    threads = (f"{a.rank_threads} BLAS/Numba thread(s) per rank" if a.rank_threads
               else "the libraries' default threads per rank")
    section = (f"## {a.tokens} tokens, gpu_budget {a.budget}, {a.ranks} ranks\n\n"
               f"`{info['command']}` at {info['commit']} ({info['platform']}, "
               f"{info['cpu_count']} cores, MLX {info['versions']['mlx']}, float32 on the CPU "
               f"backend; the ranks share the machine's cores, {threads}; the one process "
               f"keeps the default threads)\n\n{table}\n")
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
