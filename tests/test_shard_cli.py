"""``tiered run`` as two ranks of MLX's ring backend: the embedded model's pass-key demo with
the cache sharded over two ranks at gpu_budget 0.125 answers as one process's tiered cache does,
each rank holding half of the document, compressed. The ranks are started as ``mlx.launch``
starts them (a hostfile, MLX_RANK) but without its forwarding loop, which polls the ranks'
stdin pipes without sleeping and took half of this 2-core machine (README, Limitations);
tests/test_shard.py runs ``mlx.launch`` itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from test_shard import _ring


def _run(cmd, tmp_path):
    r = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_two_ranks_answer_the_pass_key_as_one_process(tmp_path):
    demo = ["-m", "tiered", "run", "--demo-tokens", "2000", "--seed", "2"]
    one = _run([sys.executable, *demo, "--json", str(tmp_path / "one.json")], tmp_path)
    # one thread per rank for BLAS and Numba: two ranks with a pool each oversubscribe the
    # cores (8k tokens on 2 cores: decode 404 ms/token against 480, bench/results)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               OMP_NUM_THREADS="1")
    codes, _, logs = _ring(tmp_path, 2, timeout=600, env=env, cmd=[
        sys.executable, *demo, "--json", str(tmp_path / "two.json")])
    assert codes == [0, 0], logs
    two = logs[0]
    a = json.loads((tmp_path / "one.json").read_text())
    b = json.loads((tmp_path / "two.json").read_text())
    assert "pass key" in one and "2 ranks" in two
    assert a["phases"] == ["compressed"]
    assert b["found"] is True and (a["expected"] in a["answer"]) is True
    # the same answer: the first number each run gives is the pass key
    assert [re.search(r"\d+", x["answer"]).group() for x in (a, b)] == [a["expected"]] * 2
    ranks = b["ranks"]
    assert len(ranks) == 2 and all(r["bytes"]["host"] > 0 for r in ranks)  # compressed shards
    assert abs(ranks[0]["held_tokens"] - ranks[1]["held_tokens"]) <= 2 * 10 + 1
