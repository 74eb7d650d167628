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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid

MANIFEST = "tiered.json"
READ_CHUNK = 8 << 20
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_OURS = re.compile(r"^(cache-[0-9a-f]{12}\.safetensors|pages-[0-9a-f]{12})$")


class SnapshotError(ValueError):
    """A cache directory that cannot be read or written as a snapshot."""


def new_id() -> str:
    return uuid.uuid4().hex[:12]


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
    for name in os.listdir(directory):
        if _OURS.match(name) and name not in keep:
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
