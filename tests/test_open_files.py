"""The limit on open files: lifted as far as allowed, and a disk tier stopped by it says so."""

from __future__ import annotations

import errno
import os
import re
import resource
import subprocess
import sys
import textwrap

import pytest
from tiered.cpu import open_files

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@linux
def test_kinds_names_what_is_open(tmp_path):
    path = tmp_path / "f1.bin"
    before = open_files.kinds()
    with open(path, "wb"), open(path, "rb"):
        now = open_files.kinds()
    folded = re.sub(r"\d+", "N", str(path))
    assert now[folded] == before[folded] + 2
    assert sum(now.values()) == sum(before.values()) + 2
    assert open_files.describe().startswith(f"{sum(open_files.kinds().values())} open of the limit ")


@linux
def test_raise_limit_lifts_the_soft_limit_to_the_hard_one_at_least():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 64 if soft == resource.RLIM_INFINITY else min(soft, 64)
    got = _run(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, ({low}, {hard}))
        from tiered.cpu import open_files
        n = open_files.raise_limit()
        s, h = resource.getrlimit(resource.RLIMIT_NOFILE)
        print(n, s, h, open_files.raise_limit())
    """).split()
    n, s, h, again = map(int, got)
    assert n == s == again  # the figure returned is the limit in force; once is enough
    inf = resource.RLIM_INFINITY
    if hard == inf:
        assert s == inf or s >= 1 << 20
    else:  # at least the hard limit; the hard limit never lowered
        assert s >= hard and (h == inf or h >= hard)


@linux
def test_disk_tier_stopped_by_the_limit_names_it(tmp_path):
    got = _run(f"""
        import errno, os, resource
        from tiered.cpu import disk, open_files
        open_files.raise_limit()
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        held = []
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as e:
            assert e.errno == errno.EMFILE
        try:
            disk.check_directory({str(tmp_path)!r})
        except disk.DiskTierError as e:
            print(e.errno, "|", e)
        for fd in held:
            os.close(fd)
        print(disk.check_directory({str(tmp_path)!r}))
    """).splitlines()
    code, msg = got[0].split(" | ", 1)
    assert int(code) == errno.EMFILE
    assert "no file can be opened" in msg and "open of the limit 48" in msg
    assert "/dev/null" in msg and "ulimit -n" in msg and "not writable" not in msg
    assert got[1] == str(tmp_path)  # with descriptors free again the directory is fine
    assert os.listdir(tmp_path) == []
