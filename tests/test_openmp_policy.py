"""``import tiered`` makes OpenMP threads sleep between parallel regions unless the user chose a
policy (tiered.runtime._platform.passive_openmp), in the process and in the OpenMP runtime
that Numba's parallel kernels then load."""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = r"""
import os, sys
import tiered
import numpy as np, numba
import tiered.cpu._numba  # the threading layer

@numba.njit(parallel=True)
def total(a):
    s = 0.0
    for i in numba.prange(a.shape[0]):
        s += a[i]
    return s

assert total(np.ones(1000)) == 1000.0
maps = open("/proc/self/maps").read()
print(os.environ.get("OMP_WAIT_POLICY"), "libgomp" in maps)
"""


def _run(env_policy):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_passive_unless_the_user_chose():
    policy, _ = _run(None)
    assert policy == "PASSIVE"
    policy, _ = _run("ACTIVE")
    assert policy == "ACTIVE"  # the user's choice stands


def test_set_before_the_openmp_runtime_loads():
    """The policy is in the environment before anything loads libgomp: the kernel above is
    the first parallel launch, and libgomp was not in the process at ``import tiered``."""
    from tiered.runtime import _platform

    saved = os.environ.pop("OMP_WAIT_POLICY", None)
    try:
        with open("/proc/self/maps") as f:
            loaded = "libgomp" in f.read()
        assert _platform.passive_openmp() is (not loaded)
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
        assert _platform.passive_openmp() is False  # set now: left alone
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)
        if saved is not None:
            os.environ["OMP_WAIT_POLICY"] = saved
