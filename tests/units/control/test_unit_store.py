"""The unit cache: files under their content names (`<sha256>.onnx`, `<sha256>.data`),
chunked, resumable, verified, atomic, and consistent on a full disk."""

import hashlib
import os
import subprocess

import pytest

from peerd.control.unit_store import StoreError, UnitStore


def _blob(size: int, seed: int = 0, suffix: str = ".onnx") -> tuple[bytes, str]:
    """Some bytes and their content name."""
    data = bytes((i * 31 + seed) % 251 for i in range(size))
    return data, hashlib.sha256(data).hexdigest() + suffix


def _send(store: UnitStore, sha: str, data: bytes, chunk: int = 1000) -> None:
    for offset in range(store.received(sha), len(data), chunk):
        store.write_chunk(sha, offset, data[offset : offset + chunk])


def test_a_unit_received_in_chunks_is_published_after_verification(tmp_path):
    store = UnitStore(tmp_path)
    data, sha = _blob(4500)
    _send(store, sha, data)
    assert not store.has(sha)
    assert store.complete(sha).read_bytes() == data
    assert store.has(sha) and store.received(sha) == len(data)


def test_an_interrupted_transfer_resumes_where_it_stopped(tmp_path):
    data, sha = _blob(5000)
    UnitStore(tmp_path).write_chunk(sha, 0, data[:2000])
    store = UnitStore(tmp_path)  # a restarted daemon
    assert store.received(sha) == 2000
    _send(store, sha, data)
    assert store.complete(sha).read_bytes() == data


def test_a_chunk_at_the_wrong_offset_is_refused_and_changes_nothing(tmp_path):
    store = UnitStore(tmp_path)
    data, sha = _blob(3000)
    store.write_chunk(sha, 0, data[:1000])
    with pytest.raises(StoreError, match="expected 1000"):
        store.write_chunk(sha, 2000, data[2000:])
    assert store.received(sha) == 1000


def test_bytes_that_do_not_match_the_hash_are_never_published(tmp_path):
    store = UnitStore(tmp_path)
    data, sha = _blob(3000)
    _send(store, sha, data[:-1] + b"\x00")
    with pytest.raises(StoreError, match="hash to"):
        store.complete(sha)
    assert not store.has(sha) and store.received(sha) == 0


def test_a_corrupted_stored_unit_is_detected_and_removed(tmp_path):
    store = UnitStore(tmp_path)
    data, sha = _blob(3000)
    _send(store, sha, data)
    path = store.complete(sha)
    path.write_bytes(b"x" + data[1:])
    assert not store.verify(sha)
    assert not store.has(sha)


def test_a_data_file_is_kept_beside_the_models_under_its_content_name(tmp_path):
    store = UnitStore(tmp_path)
    data, name = _blob(3000, suffix=".data")
    _send(store, name, data)
    assert store.complete(name) == tmp_path / name and store.verify(name)


def test_names_that_are_not_content_names_are_refused(tmp_path):
    _, name = _blob(10)
    sha = name.removesuffix(".onnx")
    for bad in ("../../etc/passwd", sha, f"{sha}.part", f"{sha}.onnx/x", f"../{sha}.data"):
        with pytest.raises(StoreError, match="not a unit file's content name"):
            UnitStore(tmp_path).write_chunk(bad, 0, b"x")


@pytest.fixture
def tiny_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_is_reported_and_leaves_the_cache_consistent(tiny_disk):
    store = UnitStore(tiny_disk / "units")
    small, small_sha = _blob(8000, seed=1)
    _send(store, small_sha, small)
    store.complete(small_sha)
    big, big_sha = _blob(200_000, seed=2)
    with pytest.raises(StoreError, match="no space left"):
        _send(store, big_sha, big, chunk=16_384)
    kept = store.received(big_sha)
    assert kept % 16_384 == 0 and kept < len(big)
    assert store.path(small_sha).read_bytes() == small
    assert store.verify(small_sha)
