"""Executors sharing unit sessions (SessionShelf), each unit in a session of its own: a new
stage over an overlapping range loads only the units it gains, answers exactly as a fresh
one, and frees what it drops. (Units joined by block: test_executor_joined.py.)"""

from __future__ import annotations

import dataclasses
import shutil
import weakref
from pathlib import Path

import numpy as np
import pytest

from shards.executor import ExecutorOptions, SessionShelf, StageExecutor, held_bytes

IDS = [3, 1, 4, 1, 5, 9, 2, 6]
ALONE = ExecutorOptions(join_bytes=0)


def _request(ids: list[int], start: int) -> dict[str, np.ndarray]:
    positions = np.arange(start, start + len(ids), dtype=np.int64)[None]
    return {"input_ids": np.array([ids], np.int64), "position_ids": positions}


def _logits(stages: list[StageExecutor], seq_id: str, ids: list[int], start: int) -> np.ndarray:
    available = dict(_request(ids, start))
    for stage in stages:
        available.update(stage.step(seq_id, {name: available[name] for name in stage.inputs}))
    return available["logits"][0]


@pytest.fixture
def units(toy, tmp_path: Path):
    """The toy's manifest and a copy of its unit files that a test may delete from."""
    _, manifest, directory = toy
    copy = tmp_path / "units"
    shutil.copytree(directory, copy)
    return manifest, copy


def _remove_files(manifest, directory: Path, *indices: int) -> None:
    for index in indices:
        for file in manifest.units[index].files:
            (directory / file.name).unlink()


def test_a_stage_over_an_overlapping_range_opens_only_the_unit_files_it_gains(toy, units):
    model, _, original = toy
    manifest, directory = units
    shelf = SessionShelf()
    old = StageExecutor(manifest, directory, 0, 1, ALONE, shelf=shelf)
    _remove_files(manifest, directory, 0, 1)  # held by `old`: a new stage must not open them

    new = StageExecutor(manifest, directory, 1, 2, ALONE, shelf=shelf)

    assert new.session(1) is old.session(1)
    assert new.session(2) is not old.session(1)
    with pytest.raises(Exception, match="NO_SUCHFILE|No such file|doesn't exist"):
        # unit 1 needs its file
        StageExecutor(manifest, directory, 1, 2, ALONE, shelf=SessionShelf())
    embed = StageExecutor(manifest, original, 0, 0)
    fresh = StageExecutor(manifest, original, 1, 2)
    shared_logits = _logits([embed, new], "s", IDS[:5], 0)
    np.testing.assert_array_equal(shared_logits, _logits([embed, fresh], "f", IDS[:5], 0))
    np.testing.assert_allclose(shared_logits, model.logits(IDS[:5]), rtol=1e-5, atol=1e-4)


def test_k_v_moves_exactly_to_a_stage_sharing_the_sessions_and_stays_its_own(toy, units):
    model, _, _ = toy
    manifest, directory = units
    shelf = SessionShelf()
    old = StageExecutor(manifest, directory, 0, 2, ALONE, shelf=shelf)
    _logits([old], "s", IDS[:5], 0)
    new_head, new_tail = (StageExecutor(manifest, directory, 0, 0, ALONE, shelf=shelf),
                          StageExecutor(manifest, directory, 1, 2, ALONE, shelf=shelf))
    for unit in (1, 2):
        new_tail.import_state("s", unit, old.export_state("s", unit))

    moved = _logits([new_head, new_tail], "s", [IDS[5]], 5)
    stayed = _logits([old], "s", [IDS[5]], 5)  # the old stage's K/V of "s" is untouched

    expected = model.logits(IDS[:6])[-1]
    np.testing.assert_array_equal(moved[-1], stayed[-1])
    np.testing.assert_allclose(moved[-1], expected, rtol=1e-5, atol=1e-4)
    assert [new_head.session(0), new_tail.session(2)] == [old.session(0), old.session(2)]


def test_another_manifest_or_other_options_never_share_a_session(units):
    manifest, directory = units
    shelf = SessionShelf()
    first = StageExecutor(manifest, directory, 0, 2, ALONE, shelf=shelf)
    other_model = StageExecutor(dataclasses.replace(manifest, key="toy-int4"), directory, 0, 2,
                                ALONE, shelf=shelf)
    one_thread = StageExecutor(manifest, directory, 0, 2, dataclasses.replace(ALONE, threads=1),
                               shelf=shelf)
    sessions = [e.session(u) for e in (first, other_model, one_thread) for u in range(3)]
    assert len({id(s) for s in sessions}) == 9


def test_a_session_is_freed_with_the_last_executor_that_runs_it(units):
    manifest, directory = units
    shelf = SessionShelf()
    old = StageExecutor(manifest, directory, 0, 1, ALONE, shelf=shelf)
    new = StageExecutor(manifest, directory, 1, 2, ALONE, shelf=shelf)
    dropped, kept = weakref.ref(old.session(0)), weakref.ref(old.session(1))
    gone = weakref.ref(old)

    del old  # its plane retired

    assert gone() is None and dropped() is None, "nothing else holds the old stage"
    assert kept() is new.session(1)
    _remove_files(manifest, directory, 0)
    with pytest.raises(Exception, match="NO_SUCHFILE|No such file|doesn't exist"):
        StageExecutor(manifest, directory, 0, 0, ALONE, shelf=shelf)  # unit 0 must load anew


def test_held_bytes_count_a_shared_session_once_and_each_stages_k_v(units):
    manifest, directory = units
    shelf = SessionShelf()
    old = StageExecutor(manifest, directory, 0, 1, ALONE, shelf=shelf)
    new = StageExecutor(manifest, directory, 1, 2, ALONE, shelf=shelf)
    apart = StageExecutor(manifest, directory, 1, 2, ALONE)
    _logits([old, StageExecutor(manifest, directory, 2, 2)], "s", IDS[:4], 0)
    weights = [u.weight_bytes for u in manifest.units]
    assert old.kv_bytes() > 0 and all(weights)

    assert held_bytes([old, new]) == sum(weights) + old.kv_bytes()
    assert held_bytes([old, apart]) == sum(weights) + weights[1] + old.kv_bytes()
    assert held_bytes([new, new]) == weights[1] + weights[2]
