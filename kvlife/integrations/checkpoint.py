"""What identifies a checkpoint's weights, cheaply at start (no runtime imported here).

A persistent KV tier must never serve one checkpoint's KV to another, and a full hash of
a 100 GB checkpoint at every start is too slow. So each file is known by what changes
whenever its bytes change: a hub cache blob by its content-derived name, a file of up to
:data:`WHOLE_BYTES` by a hash of its bytes, a larger one by its size, inode and ns times
(no byte read). What is and is not detected, and what a false change costs:
``docs/vllm.md``, "The persistent tier".
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

__all__ = ["WHOLE_BYTES", "checkpoint_fingerprint", "file_identity", "hub_snapshot"]

#: Files up to this size are hashed whole; larger ones are known by their metadata.
WHOLE_BYTES = 16 << 20

#: A hub cache blob's name: git's sha1 of a small file, the sha256 of an LFS one.
_BLOB = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def _skipped(name: str) -> bool:
    """Files of a checkpoint directory that never change the KV it computes."""
    return name.startswith(".") or name.endswith(".md") or name.upper().startswith("LICENSE")


def file_identity(path: str) -> list[Any]:
    """One file's identity (see the module's docstring): ``["blob", name, size]``,
    ``["bytes", digest, size]`` or ``["stat", size, inode, mtime_ns, ctime_ns]``."""
    st = os.stat(path)
    if os.path.islink(path):
        target = os.path.realpath(path)
        parent, name = os.path.split(target)
        if os.path.basename(parent) == "blobs" and _BLOB.fullmatch(name):
            return ["blob", name, st.st_size]
    if st.st_size <= WHOLE_BYTES:
        h = hashlib.blake2b(digest_size=16)
        size = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
                size += len(chunk)
        return ["bytes", h.hexdigest(), size]
    return ["stat", st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def checkpoint_fingerprint(
    model: str, revision: str | None = None, *, cache_dir: str | None = None
) -> dict[str, Any]:
    """What identifies the weights behind ``model`` (a directory, a single weight file or a
    hub name cached on this machine, in ``cache_dir`` or the hub's default cache) without
    reading large files: ``{"revision": revision, "files": {name: identity}}``
    (:func:`file_identity`). ``"files"`` is None where ``model`` is none of those: the
    caller knows the weights by name and revision only."""
    found: dict[str, Any] = {"revision": revision, "files": None}
    if os.path.isfile(model):
        found["files"] = {os.path.basename(model): file_identity(model)}
        return found
    directory = model if os.path.isdir(model) else hub_snapshot(model, revision, cache_dir)
    if directory is None:
        return found
    files: dict[str, Any] = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not _skipped(name) and os.path.isfile(path):
            files[name] = file_identity(path)
    found["files"] = files
    return found


def hub_snapshot(model: str, revision: str | None, cache_dir: str | None = None) -> str | None:
    """The local snapshot directory of a hub model, if cached (no network)."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            model, revision=revision, cache_dir=cache_dir, local_files_only=True
        )
    except Exception:  # not a hub name, no hub package, not cached: None
        return None
    return str(path)
