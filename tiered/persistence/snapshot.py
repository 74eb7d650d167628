"""A saved cache's files: names that stay inside its directory, checksums, an atomic manifest.

A cache directory holds one snapshot at a time:

- ``tiered.json``, the manifest: what was saved (model, config, layers, tokens) and every data
  file of the snapshot by relative name, with its size and SHA-256 (a damaged or swapped file
  is refused at load; hashing streams at ~1.3 GB/s on this machine's SHA extensions);
- the data files, whose names carry the snapshot's id (``cache-<id>.safetensors``,
  ``pages-<id>/<layer>-<tensor>.pages``), so a new save never overwrites the files of the
  snapshot it replaces.

A save writes its data files, flushes them, then writes the manifest under a temporary name
in the directory, flushes it and renames it over ``tiered.json``: until that rename the
previous snapshot is intact and is the one a load sees; after it, the previous snapshot's
files are removed. A save that fails removes what it wrote. Names read from a manifest are
accepted only as one or two plain components (no absolute path, no ``..``, no symbolic link),
resolved inside the directory.

One save writes a directory at a time (an exclusive ``flock`` on ``.tiered-save.lock``, held
from the first data file to the removal of the replaced snapshot's files); a load holds a
shared lock on ``.tiered-read.lock`` while it reads, and the save takes that one alone only to
remove the files of the snapshot it replaced. Locks are per open file, so they order threads
of one process as well as processes. The manifest carries a digest of its own fields: a
manifest edited by hand is refused as damaged.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import uuid

from ..planning.step_guard import SnapshotError

MANIFEST = "tiered.json"
SAVE_LOCK = ".tiered-save.lock"
READ_LOCK = ".tiered-read.lock"
log = logging.getLogger("tiered")
READ_CHUNK = 8 << 20
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_OURS = re.compile(r"^(cache-[0-9a-f]{12}\.safetensors|pages-[0-9a-f]{12})$")
_STALE_TMP = re.compile(r"^\.tiered\.json\.[0-9a-f]{12}\.tmp$")  # a killed save's manifest


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def manifest_digest(meta: dict) -> str:
    """SHA-256 of a manifest's fields (all but ``digest`` itself), in a canonical form."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


@contextlib.contextmanager
def _flock(directory: str, name: str, exclusive: bool, what: str, required: bool):
    """Hold ``flock`` on ``directory/name`` (created if needed). Where it cannot be created
    (a read-only directory: nothing can be saved there either) and not ``required``, go on
    without it."""
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if required:
            raise SnapshotError(f"cannot lock {directory!r} for {what}: {e}") from None
        yield
        return
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("tiered: waiting for %s of %s", "another save" if exclusive else
                     "a save", directory)
            fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # releases the lock


def writer(directory: str):
    """The directory's save lock: one save at a time, across threads and processes."""
    return _flock(directory, SAVE_LOCK, True, "a save", required=True)


def reader(directory: str):
    """A shared lock for reading a snapshot: its files stay until the read ends."""
    return _flock(directory, READ_LOCK, False, "a load", required=False)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(READ_CHUNK)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(directory: str, name) -> str:
    """The path of ``name`` (a manifest entry) inside ``directory``; SnapshotError for
    anything that could reach outside it."""
    if not isinstance(name, str) or not name:
        raise SnapshotError(f"Invalid file name {name!r} in {MANIFEST}: expected a string")
    parts = name.split("/")
    if len(parts) > 2 or any(not _PART.match(p) for p in parts):
        raise SnapshotError(f"Invalid file name {name!r} in {MANIFEST}: only plain names "
                            "inside the cache directory are allowed")
    path = directory
    for p in parts:
        path = os.path.join(path, p)
        if os.path.islink(path):
            raise SnapshotError(f"{name!r} in {directory!r} is a symbolic link: refused")
    return path


def describe_files(directory: str, names: list[str]) -> dict:
    """{name: {"bytes", "sha256"}} of files written into ``directory`` (flushed first)."""
    out = {}
    for name in names:
        path = resolve(directory, name)
        fsync_path(path)
        out[name] = {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}
    return out


def read_manifest(directory: str) -> dict:
    """The manifest of ``directory``, its files checked (names, sizes, SHA-256)."""
    if not os.path.isdir(directory):
        raise SnapshotError(f"{directory!r} is not a directory")
    path = os.path.join(directory, MANIFEST)
    if os.path.islink(path) or not os.path.isfile(path):
        raise SnapshotError(f"{directory!r} is not a tiered cache directory (no {MANIFEST})")
    if os.path.getsize(path) > 64 << 20:
        raise SnapshotError(f"{path!r} is too large to be a manifest")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotError(f"{path!r} is damaged ({e})") from None
    if not isinstance(meta, dict):
        raise SnapshotError(f"{path!r} is damaged (not a JSON object)")
    if meta.get("digest") != manifest_digest(meta):
        raise SnapshotError(f"{path!r} was changed after it was saved (its digest does not "
                            "match its fields): the snapshot is damaged or edited")
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        raise SnapshotError(f"{path!r} lists no data files")
    for name, info in files.items():
        target = resolve(directory, name)
        if not isinstance(info, dict) or not isinstance(info.get("bytes"), int) or \
                not isinstance(info.get("sha256"), str):
            raise SnapshotError(f"Invalid entry for {name!r} in {MANIFEST}")
        if not os.path.isfile(target):
            raise SnapshotError(f"{name!r} of the saved cache in {directory!r} is missing")
        size = os.path.getsize(target)
        if size != info["bytes"]:
            raise SnapshotError(f"{name!r} in {directory!r} has {size} bytes, the manifest says "
                                f"{info['bytes']}: the snapshot is damaged")
        if sha256_file(target) != info["sha256"]:
            raise SnapshotError(f"{name!r} in {directory!r} does not match its checksum: the "
                                "snapshot is damaged or its files come from another save")
    return meta


def commit(directory: str, meta: dict) -> None:
    """Write ``meta`` as the manifest atomically, then remove the files of the snapshot it
    replaces (ours only: names of our pattern that the new manifest does not list)."""
    meta = dict(meta, digest=manifest_digest(meta))
    tmp = os.path.join(directory, f".{MANIFEST}.{new_id()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, MANIFEST))
        fsync_path(directory)
    except BaseException:
        _remove(tmp)
        raise
    keep = {n.split("/")[0] for n in meta["files"]}
    with _flock(directory, READ_LOCK, True, "removing a replaced snapshot", required=False):
        for name in os.listdir(directory):
            if (_OURS.match(name) and name not in keep) or _STALE_TMP.match(name):
                _remove(os.path.join(directory, name))


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except OSError:
        pass


def discard(directory: str, names: list[str]) -> None:
    """Remove what a failed save wrote (top-level entries of ``names``)."""
    for top in {n.split("/")[0] for n in names}:
        if _OURS.match(top):
            _remove(os.path.join(directory, top))
