"""The command line on jemalloc (tiered.runtime.allocator): ``tiered`` / ``python -m tiered``
starts itself again, once, with jemalloc preloaded where one is installed; ``TIERED_MALLOC``
turns it off or names the library; a library that cannot be preloaded leaves the program on
the system allocator, started twice at most."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tiered.runtime import allocator


@pytest.mark.parametrize("argv,expected", [
    (["python", "-m", "tiered", "run"], True),
    (["python", "-X", "importtime", "-m", "tiered", "info"], True),
    (["/usr/bin/python3", "/usr/local/bin/tiered", "run", "--demo-tokens", "9"], True),
    (["python", "-X", "dev", "/venv/bin/tiered", "info"], True),
    (["python", "-m", "tiered.runtime.allocator"], False),
    (["python", "-m", "pytest", "tests"], False),
    (["python", "-c", "import tiered"], False),
    (["python", "app.py", "tiered"], False),
    (["python"], False),
])
def test_the_command_line_is_told_from_other_programs(monkeypatch, argv, expected):
    monkeypatch.setattr(sys, "orig_argv", argv, raising=False)
    assert allocator.is_tiered_command() is expected


def test_the_setting_names_or_refuses_the_library(monkeypatch, tmp_path):
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"\0")
    monkeypatch.setenv("TIERED_MALLOC", str(lib))
    assert allocator.find_jemalloc() == str(lib)
    monkeypatch.setenv("TIERED_MALLOC", str(tmp_path / "missing.so"))
    assert allocator.find_jemalloc() is None
    for off in ("glibc", "default", "system", "0"):
        monkeypatch.setenv("TIERED_MALLOC", off)
        assert allocator.find_jemalloc() is None
        assert allocator.restart_with_jemalloc() is False  # nothing to restart with


def test_a_restarted_program_is_not_restarted_again(monkeypatch):
    monkeypatch.setenv(allocator.TRIED, "1")
    assert allocator.restart_with_jemalloc() is False


def _info(env) -> dict:
    r = subprocess.run([sys.executable, "-m", "tiered", "info", "--json"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(r.stdout[r.stdout.index("{"):])


def _env(**kw):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TIERED_MALLOC", allocator.TRIED, "LD_PRELOAD")}
    return dict(env, **kw)


def test_the_command_line_runs_on_jemalloc_where_installed():
    if allocator.find_jemalloc() is None:
        message = "no jemalloc library here (Debian: libjemalloc2)"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must install it: see the README's test command)")
        pytest.skip(message)
    assert _info(_env())["allocator"]["in_use"] == "jemalloc"
    assert _info(_env(TIERED_MALLOC="glibc"))["allocator"]["in_use"] == "system"


def test_a_library_that_cannot_be_preloaded_leaves_the_system_allocator(tmp_path):
    bad = tmp_path / "libjemalloc.so.2"
    bad.write_text("not a shared library")
    got = _info(_env(TIERED_MALLOC=str(bad)))
    assert got["allocator"]["in_use"] == "system" and got["allocator"]["jemalloc"] == str(bad)
