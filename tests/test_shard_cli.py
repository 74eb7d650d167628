"""``tiered run`` as two ranks of MLX's ring backend: the embedded model's pass-key demo with
the cache sharded over two ranks at gpu_budget 0.125 answers as one process's tiered cache does,
each rank holding half of the document, compressed. The ranks are started as ``mlx.launch``
starts them (a hostfile, MLX_RANK) but without its forwarding loop, which polls the ranks'
stdin pipes without sleeping and took half of this 2-core machine (README, Limitations);
tests/test_shard.py runs ``mlx.launch`` itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_shard import _free_ports


def _run(cmd, tmp_path):
    r = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_two_ranks_answer_the_pass_key_as_one_process(tmp_path):
    demo = ["-m", "tiered", "run", "--demo-tokens", "3000", "--seed", "2"]
    one = _run([sys.executable, *demo, "--json", str(tmp_path / "one.json")], tmp_path)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(2)]))
    # one thread per rank for BLAS and Numba: two ranks with a pool each oversubscribe the
    # cores (8k tokens on 2 cores: decode 404 ms/token against 480, bench/results)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               OMP_NUM_THREADS="1", MLX_HOSTFILE=str(hosts))
    ranks = [subprocess.Popen([sys.executable, *demo, "--json", str(tmp_path / "two.json")],
                              cwd=str(tmp_path), env=dict(env, MLX_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        logs = [p.communicate(timeout=600)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    two = logs[0]
    a = json.loads((tmp_path / "one.json").read_text())
    b = json.loads((tmp_path / "two.json").read_text())
    assert "pass key" in one and "2 ranks" in two
    assert a["phases"] == ["compressed"]
    assert b["found"] is True and (a["expected"] in a["answer"]) is True
    ranks = b["ranks"]
    assert len(ranks) == 2 and all(r["bytes"]["host"] > 0 for r in ranks)  # compressed shards
    assert abs(ranks[0]["held_tokens"] - ranks[1]["held_tokens"]) <= 2 * 10 + 1
