"""StageExecutor over hand-built ONNX units (tests/toy_units.py): state, routing, accounting."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shards.executor import ExecutorOptions, StageExecutor

IDS = [3, 1, 4, 1, 5, 9, 2, 6]


def _request(ids: list[int], start: int) -> dict[str, np.ndarray]:
    positions = np.arange(start, start + len(ids), dtype=np.int64)[None]
    return {"input_ids": np.array([ids], np.int64), "position_ids": positions}


def _run(stages: list[StageExecutor], seq_id: str, request: dict) -> np.ndarray:
    """One step through the stages; every stage gets what it needs from earlier ones."""
    available = dict(request)
    for stage in stages:
        available.update(stage.step(seq_id, {name: available[name] for name in stage.inputs}))
    return available["logits"][0]


def _generate_logits(stages: list[StageExecutor], seq_id: str, prompt: int) -> np.ndarray:
    rows = [_run(stages, seq_id, _request(IDS[:prompt], 0))]
    for position in range(prompt, len(IDS)):
        rows.append(_run(stages, seq_id, _request([IDS[position]], position))[-1:])
    return np.concatenate(rows)


@pytest.mark.parametrize("cuts", [[(0, 2)], [(0, 0), (1, 2)], [(0, 0), (1, 1), (2, 2)]])
def test_prefill_then_decode_matches_reference_at_every_split(toy, cuts):
    model, manifest, directory = toy
    stages = [StageExecutor(manifest, directory, a, b) for a, b in cuts]
    logits = _generate_logits(stages, "s", prompt=3)
    np.testing.assert_allclose(logits, model.logits(IDS), rtol=1e-5, atol=1e-4)


def test_stage_inputs_and_outputs_follow_the_dependency_maps(toy):
    _, manifest, directory = toy
    tail = StageExecutor(manifest, directory, 1, 2)
    assert tail.inputs == {"hidden0": 0, "bias": 0}
    assert tail.outputs == {"logits": (-1,)}
    head = StageExecutor(manifest, directory, 0, 0)
    assert head.outputs == {"hidden0": (1,), "bias": (1, 2)}
    assert manifest.residual() == {(0, "bias"): (2,)}
    assert manifest.sequential() == {(0, "hidden0"): 1, (0, "bias"): 1, (1, "hidden1"): 2}


def test_sequences_are_independent_and_drop_frees_their_state(toy):
    model, manifest, directory = toy
    stage = StageExecutor(manifest, directory, 0, 2)
    first = _run([stage], "a", _request(IDS[:4], 0))
    _run([stage], "b", _request([7, 7], 0))
    assert stage.sequence_count == 2
    assert stage.kv_bytes() == (4 + 2) * 16
    stage.drop("b")
    assert stage.sequence_count == 1 and stage.kv_bytes() == 4 * 16
    np.testing.assert_allclose(first, model.logits(IDS[:4]), rtol=1e-5, atol=1e-4)
    stage.drop("a")
    again = _run([stage], "a", _request(IDS[:4], 0))
    np.testing.assert_array_equal(again, first)


def test_state_moves_between_executors_with_its_unit(toy):
    model, manifest, directory = toy
    old = StageExecutor(manifest, directory, 0, 2)
    _run([old], "s", _request(IDS[:5], 0))
    embed, tail = StageExecutor(manifest, directory, 0, 0), StageExecutor(manifest, directory, 1, 2)
    tail.import_state("s", 1, old.export_state("s", 1))
    logits = _run([embed, tail], "s", _request([IDS[5]], 5))
    np.testing.assert_allclose(logits[-1], model.logits(IDS[:6])[-1], rtol=1e-5, atol=1e-4)


def test_float16_activations_are_accepted(toy):
    model, manifest, directory = toy
    embed, tail = StageExecutor(manifest, directory, 0, 0), StageExecutor(manifest, directory, 1, 2)
    sent = embed.step("s", _request(IDS[:3], 0))
    logits = tail.step("s", {k: v.astype(np.float16) for k, v in sent.items()})["logits"][0]
    np.testing.assert_allclose(logits, model.logits(IDS[:3]), rtol=1e-2, atol=5e-2)


def test_bad_use_gets_clear_errors(toy):
    _, manifest, directory = toy
    with pytest.raises(ValueError, match="not within"):
        StageExecutor(manifest, directory, 1, 3)
    stage = StageExecutor(manifest, directory, 1, 2)
    with pytest.raises(ValueError, match="missing inputs"):
        stage.step("s", {"hidden0": np.zeros((1, 1, 4), np.float32)})
    with pytest.raises(KeyError, match="not on this stage"):
        stage.export_state("s", 0)
    with pytest.raises(ValueError, match="does not fit"):
        stage.import_state("s", 1, {"past_s": np.zeros((1, 2, 3, 4), np.float32)})


@pytest.mark.parametrize(("threads", "expected"), [(0, len(os.sched_getaffinity(0))), (1, 1)])
def test_thread_count_is_set_explicitly(toy, threads, expected):
    # 0 must not reach ONNX Runtime: its own default pins pool threads to cores
    _, manifest, directory = toy
    stage = StageExecutor(manifest, directory, 0, 2, ExecutorOptions(threads=threads))
    assert [s.get_session_options().intra_op_num_threads for s in stage.sessions] == (
        [expected] * len(stage.sessions))


@pytest.mark.parametrize("spinning", [False, True])
def test_spinning_workers_stop_when_each_run_ends(toy, spinning):
    # workers spinning on after a run would take the cores the next stage needs
    _, manifest, directory = toy
    stage = StageExecutor(manifest, directory, 0, 2, ExecutorOptions(spinning=spinning))
    for session in stage.sessions:
        entry = session.get_session_options().get_session_config_entry
        assert entry("session.intra_op.allow_spinning") == str(int(spinning))
        assert entry("session.force_spinning_stop") == str(int(spinning))


@pytest.mark.parametrize("options", [ExecutorOptions(),
                                     ExecutorOptions(memory_arena=False, prepacking=False)])
def test_memory_options_reach_every_session(toy, options):
    _, manifest, directory = toy
    stage = StageExecutor(manifest, directory, 0, 2, options)
    for session in stage.sessions:
        session_options = session.get_session_options()
        assert session_options.enable_cpu_mem_arena is options.memory_arena
        if options.memory_arena:  # the process's one arena, not one of the session's own
            assert session_options.get_session_config_entry("session.use_env_allocators") == "1"
        disabled = session_options.get_session_config_entry("session.disable_prepacking")
        assert disabled == str(int(not options.prepacking))


def test_memory_options_do_not_change_the_answer(toy):
    _, manifest, directory = toy
    logits = [_generate_logits([StageExecutor(manifest, directory, 0, 2, options)], "s", 3)
              for options in (ExecutorOptions(),
                              ExecutorOptions(memory_arena=False, prepacking=False))]
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-6)
