"""The host allocator: jemalloc for the processes tiered starts itself (Linux).

Building a decode step's graph is mostly small C++ allocations inside MLX (every array node,
its inputs, its primitive) and Python's own; glibc's malloc serves them slower than jemalloc.
The device step's host work with zero-cost kernels (``python
bench/probes/device_python_local.py --layers 32 --context 16384 --steps 30 --no-async
--no-cprofile``, 2-core CPU host): tiered 10.76-10.86 ms a token with glibc, 8.30-8.55 with
jemalloc; mlx-lm's ``KVCache`` 3.17-3.24 against 2.32-2.39. tcmalloc (9.31-9.98), mimalloc
(8.78-9.19) and glibc's tunables (tcache, arenas, thresholds: 10.2-11.3) gain less.

An allocator is chosen when a process starts, so only a program can choose it:
``tiered run`` (and ``python -m tiered``) and the scripts under ``bench/`` start themselves
once more with ``LD_PRELOAD`` naming jemalloc where one is installed (Debian:
``libjemalloc2``) and not already in use. In your own program:
``LD_PRELOAD=$(tiered info --preload) python app.py``. ``TIERED_MALLOC``: ``auto`` (the
default), ``glibc`` (no restart: the system allocator; ``default`` too, which also leaves
glibc's settings as they are: :func:`tiered.runtime._platform.bounded_malloc`), or the path
of a jemalloc library.

Only the standard library here: the command line calls :func:`restart_with_jemalloc` before
tiered imports MLX.
"""

from __future__ import annotations

import ctypes.util
import os
import sys

# Where distributions put it (Debian / Ubuntu, Fedora / RHEL, a source build).
CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
              "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
              "/usr/lib64/libjemalloc.so.2", "/usr/local/lib/libjemalloc.so.2")
TRIED = "TIERED_MALLOC_RESTARTED"  # set in the restarted process: never restart twice
OFF = ("glibc", "default", "system", "0", "off")


def choice() -> str:
    """``TIERED_MALLOC``, or ``auto``."""
    return os.environ.get("TIERED_MALLOC", "auto").strip() or "auto"


def turned_off() -> bool:
    """Whether ``TIERED_MALLOC`` keeps the system allocator."""
    return choice().lower() in OFF


def find_jemalloc() -> str | None:
    """The jemalloc library to preload: ``TIERED_MALLOC``'s path, else an installed one; None
    where there is none (or not on Linux, or ``TIERED_MALLOC`` turns it off)."""
    want = choice()
    if not sys.platform.startswith("linux") or turned_off():
        return None
    if want != "auto":
        return want if os.path.isfile(want) else None
    for path in CANDIDATES:
        if os.path.isfile(path):
            return path
    name = ctypes.util.find_library("jemalloc")  # e.g. 'libjemalloc.so.2' on the loader path
    return name or None


def in_use() -> str:
    """``jemalloc`` where this process runs on it, else ``system`` (glibc on Linux)."""
    try:
        with open("/proc/self/maps") as f:
            return "jemalloc" if "libjemalloc" in f.read() else "system"
    except OSError:
        return "system"


def restart_argv() -> list[str] | None:
    """The command line that starts this program again (interpreter options included), or
    None where it cannot be repeated (code read from stdin, an embedded interpreter)."""
    argv = list(getattr(sys, "orig_argv", []) or [])
    if len(argv) < 2 or argv[1:2] == ["-"] or not sys.executable:
        return None
    return [sys.executable, *argv[1:]]


def restart_with_jemalloc() -> bool:
    """Start this program again, in place (``os.execv``: same process id, same environment
    plus ``LD_PRELOAD``), on jemalloc, where it is installed, allowed and not in use yet, once.
    Returns False where it did not (it does not return where it did)."""
    if os.environ.get(TRIED) or in_use() == "jemalloc":
        return False
    lib, argv = find_jemalloc(), restart_argv()
    if lib is None or argv is None:
        return False
    env = dict(os.environ)
    env[TRIED] = "1"
    env["LD_PRELOAD"] = " ".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    try:
        os.execve(sys.executable, argv, env)
    except OSError:
        return False
    return True  # not reached


def is_tiered_command() -> bool:
    """Whether this process is ``tiered`` / ``python -m tiered`` (the command line)."""
    argv = list(getattr(sys, "orig_argv", []) or [])[1:]
    if "-m" in argv:
        return argv[argv.index("-m") + 1: argv.index("-m") + 2] == ["tiered"]
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "-c":
            return False
        i += 2 if argv[i] in ("-X", "-W") else 1  # options that take a value
    return i < len(argv) and os.path.basename(argv[i]) == "tiered"
