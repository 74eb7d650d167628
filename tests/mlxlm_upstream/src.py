"""mlx-lm's own test files, fetched from its source distribution when the tests run.

The installed mlx-lm wheel has no tests, and we vendor no code, so the first run downloads the
0.32.2 sdist with pip (the index checks its hash; we check it again against :data:`SDIST_SHA256`),
extracts only its ``tests/`` folder into a cache directory and writes the hash beside it.
Later runs reuse that folder when the hash file matches and every file is there.

Cache directory: ``$TIERED_MLXLM_SRC`` or ``~/.cache/tiered/mlx-lm-0.32.2-src``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.32.2"
SDIST = f"mlx_lm-{VERSION}.tar.gz"
SDIST_SHA256 = "1af8a92f6a141c3e2bf5b0369ac4464203a8e2189c47b9e40d3e921e5b3a1fe9"
FILES = ("test_prompt_cache.py", "test_generate.py", "test_models.py")
ENV = "TIERED_MLXLM_SRC"
PIP_TIMEOUT_S = 300


class SourcesUnavailable(RuntimeError):
    """The upstream test files could not be fetched; the message says why."""


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "tiered" / f"mlx-lm-{VERSION}-src"
    return Path(os.environ.get(ENV) or default)


def _complete(root: Path) -> bool:
    marker = root / "SDIST_SHA256"
    return (marker.is_file() and marker.read_text().strip() == SDIST_SHA256
            and all((root / "tests" / f).is_file() for f in FILES))


def tests_dir() -> Path:
    """The folder holding mlx-lm 0.32.2's ``tests/*.py``; downloads it on first use.

    Raises :class:`SourcesUnavailable` when pip cannot fetch the sdist or it is not the file
    whose hash we pinned.
    """
    root = cache_dir()
    if _complete(root):
        return root / "tests"
    with tempfile.TemporaryDirectory(prefix="tiered-mlxlm-sdist-") as tmp:
        tarball = _download(Path(tmp))
        # Extract beside the destination and rename, so an interrupted run leaves no half folder.
        root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
        try:
            _extract_tests(tarball, staging)
            (staging / "SDIST_SHA256").write_text(SDIST_SHA256 + "\n")
            if root.exists():
                shutil.rmtree(root)
            staging.rename(root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if not _complete(root):
        raise SourcesUnavailable(f"{root} is incomplete after extraction (expected {FILES})")
    return root / "tests"


def _download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
           "--disable-pip-version-check", f"mlx-lm=={VERSION}", "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SourcesUnavailable(f"`{' '.join(cmd)}` did not run: {exc}") from exc
    tarball = dest / SDIST
    if proc.returncode != 0 or not tarball.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SourcesUnavailable(
            f"`pip download` of mlx-lm {VERSION}'s sdist failed (exit {proc.returncode}): "
            f"{tail[0]}")
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SourcesUnavailable(f"{SDIST} has sha256 {digest}, expected {SDIST_SHA256}")
    return tarball


def _extract_tests(tarball: Path, dest: Path) -> None:
    prefix = f"mlx_lm-{VERSION}/tests/"
    (dest / "tests").mkdir()
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar.getmembers():
            name = member.name[len(prefix):]
            # Flat regular files only: nothing can land outside dest/tests.
            if member.name.startswith(prefix) and member.isfile() and name and "/" not in name:
                with tar.extractfile(member) as src:
                    (dest / "tests" / name).write_bytes(src.read())
