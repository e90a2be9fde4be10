"""The checkpoint fingerprint (``kvlife.integrations.checkpoint``) that namespaces the vLLM
backend's persistent tier: it changes whenever a byte of the weights may have changed,
stays put when none did, and reads no byte of a large weight file (a 100 GB checkpoint
is fingerprinted in milliseconds). The namespace built on it is tested against vLLM's
own types in ``tests/integration/test_vllm_start.py``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvlife.integrations.checkpoint import WHOLE_BYTES, checkpoint_fingerprint


def _big(path: Path, size: int = WHOLE_BYTES + (1 << 20)) -> None:
    """A large weight file, sparse (no disk used): it is never read, only stat'ed."""
    with open(path, "wb") as f:
        f.truncate(size)


def _checkpoint(directory: Path) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text('{"hidden_size": 64}')
    (directory / "README.md").write_text("a model")
    _big(directory / "model-00001-of-00002.safetensors")
    _big(directory / "model-00002-of-00002.safetensors")
    return directory


def test_a_100_gb_checkpoint_is_fingerprinted_without_reading_its_weights(
    tmp_path: Path,
) -> None:
    """20 shards of 5 GB (sparse files), an index and a 10 MiB tokenizer: the fingerprint
    stats the shards and hashes the small files. Reading the shards would take minutes."""
    model = tmp_path / "model"
    model.mkdir()
    for i in range(20):
        _big(model / f"model-{i:05d}-of-00020.safetensors", 5 << 30)
    (model / "model.safetensors.index.json").write_text("{}" * 50_000)
    (model / "tokenizer.json").write_bytes(os.urandom(10 << 20))
    (model / "config.json").write_text('{"hidden_size": 8192}')
    checkpoint_fingerprint(str(model))  # the small files into the page cache, as at a restart
    start = time.perf_counter()
    found = checkpoint_fingerprint(str(model))
    seconds = time.perf_counter() - start
    assert len(found["files"]) == 23
    assert seconds < 2.0, f"{seconds:.2f} s for a 100 GB checkpoint"


def test_a_write_in_place_with_its_modification_time_set_back_is_detected(
    tmp_path: Path,
) -> None:
    """Scenario: a tool writes a tensor in place and restores the file's modification time
    (``os.utime``, as ``rsync -t`` or ``cp -p`` would). Size, inode and mtime are as before;
    the change time moved, and the kernel never lets it be set back."""
    model = _checkpoint(tmp_path / "model")
    shard = model / "model-00001-of-00002.safetensors"
    first = checkpoint_fingerprint(str(model))
    before = shard.stat()
    time.sleep(0.05)  # past the file system's timestamp granularity
    with open(shard, "r+b") as f:
        f.seek(12345678)
        f.write(b"fine-tuned")
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = shard.stat()
    assert (after.st_size, after.st_ino, after.st_mtime_ns) == (
        before.st_size,
        before.st_ino,
        before.st_mtime_ns,
    )
    assert checkpoint_fingerprint(str(model)) != first


def test_a_shard_replaced_by_rename_or_a_small_file_edited_is_detected(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "model")
    first = checkpoint_fingerprint(str(model))
    assert checkpoint_fingerprint(str(model)) == first  # nothing changed
    (model / "README.md").write_text("docs change no KV")
    (model / ".cache").mkdir()  # hidden, and a directory
    assert checkpoint_fingerprint(str(model)) == first
    (model / "config.json").write_text('{"hidden_size": 64}')  # rewritten, the same bytes
    assert checkpoint_fingerprint(str(model)) == first
    (model / "config.json").write_text('{"hidden_size": 65}')
    assert checkpoint_fingerprint(str(model)) != first
    (model / "config.json").write_text('{"hidden_size": 64}')
    assert checkpoint_fingerprint(str(model)) == first
    shard = model / "model-00002-of-00002.safetensors"
    _big(model / "new.tmp")
    os.replace(model / "new.tmp", shard)  # saved beside it and renamed over: a new inode
    assert checkpoint_fingerprint(str(model)) != first
    (model / "modeling_custom.py").write_text("# remote code changes the model")
    assert set(checkpoint_fingerprint(str(model))["files"]) > set(first["files"])


def test_a_single_file_checkpoint_and_an_unknown_name(tmp_path: Path) -> None:
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    found = checkpoint_fingerprint(str(gguf))
    assert list(found["files"]) == ["x.gguf"]
    gguf.write_bytes(b"GGUF" + bytes(999) + b"\1")
    assert checkpoint_fingerprint(str(gguf)) != found
    # Not a path, not a cached hub model: known by name and revision only (files None).
    unknown = checkpoint_fingerprint("no-such-org/no-such-model", "main", cache_dir=str(tmp_path))
    assert unknown == {"revision": "main", "files": None}


def _hub_cache(root: Path, blobs: dict[str, tuple[str, bytes]]) -> None:
    """A hub cache holding one snapshot of ``org/model`` (the layout huggingface_hub
    writes): each file a link to its blob, named by its hash."""
    repo = root / "models--org--model"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, (blob, data) in blobs.items():
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob))


def test_the_same_hub_snapshot_on_two_machines_has_one_fingerprint(tmp_path: Path) -> None:
    """Two machines downloaded one revision at different times (other inodes and times):
    the hub names each blob by its content, so both share one namespace; another blob
    under a file's name is another fingerprint."""
    pytest.importorskip("huggingface_hub")
    files = {"config.json": ("a" * 40, b"{}"), "model.safetensors": ("b" * 64, b"\0" * 64)}
    _hub_cache(tmp_path / "one", files)
    time.sleep(0.05)
    _hub_cache(tmp_path / "two", files)
    one = checkpoint_fingerprint("org/model", cache_dir=str(tmp_path / "one"))
    two = checkpoint_fingerprint("org/model", cache_dir=str(tmp_path / "two"))
    assert one["files"] is not None and one == two
    files["model.safetensors"] = ("c" * 64, b"\1" * 64)
    _hub_cache(tmp_path / "three", files)
    assert checkpoint_fingerprint("org/model", cache_dir=str(tmp_path / "three")) != one
