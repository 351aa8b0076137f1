"""Units joined into one session per block (shards/joined.py): the same answer bit for bit as
each unit in a session of its own, the blocks every stage agrees on, and what a new stage
shares with an old one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from sharding import sharded

from shards.early_exit import EXIT_HIDDEN, exit_point
from shards.executor import ExecutorOptions, SessionShelf, StageExecutor, held_bytes
from shards.joined import JOIN_BYTES, JOIN_WHOLE, blocks
from shards.manifest import Manifest

ALONE = ExecutorOptions(join_bytes=0)
JOINED = ExecutorOptions(join_bytes=JOIN_BYTES)
PROMPT = [1, 17, 42, 99, 7, 250]


@pytest.fixture(scope="module")
def llama(hf_checkpoint):
    return sharded(hf_checkpoint("llama", num_hidden_layers=4))


def _layer_bytes(manifest: Manifest) -> int:
    """Join bytes that make blocks of a decoder layer or two."""
    return 2 * sum(u.weight_bytes for u in manifest.units if u.name.startswith("layer0"))


def _steps(stages: list[StageExecutor], seq_ids: list[str], decodes: int) -> list[np.ndarray]:
    """Each sequence's prefill of its own prompt, then `decodes` greedy steps run as one
    batch; every step's logits."""
    logits = []
    prompts = {seq_id: PROMPT[: 3 + i] for i, seq_id in enumerate(seq_ids)}
    for seq_id, prompt in prompts.items():
        out = _through(stages, [(seq_id, {"input_ids": np.array([prompt]),
                                          "position_ids": np.arange(len(prompt))[None]})])
        logits.append(out[0])
    tokens = {seq_id: int(np.argmax(row[0, -1])) for seq_id, row in zip(seq_ids, logits,
                                                                          strict=True)}
    for step in range(decodes):
        asks = [(seq_id, {"input_ids": np.array([[tokens[seq_id]]]),
                          "position_ids": np.array([[len(prompts[seq_id]) + step]])})
                for seq_id in seq_ids]
        for seq_id, row in zip(seq_ids, _through(stages, asks), strict=True):
            logits.append(row)
            tokens[seq_id] = int(np.argmax(row[0, -1]))
    return logits


def _through(stages: list[StageExecutor], asks: list[tuple[str, dict]]) -> list[np.ndarray]:
    available = [dict(inputs) for _, inputs in asks]
    for stage in stages:
        outcomes = stage.step_many([(seq_id, {n: values[n] for n in stage.inputs})
                                    for (seq_id, _), values in zip(asks, available, strict=True)])
        for values, outcome in zip(available, outcomes, strict=True):
            assert not isinstance(outcome, Exception), outcome
            values.update(outcome)
    return [values["logits"] for values in available]


def test_blocks_cover_the_units_in_order_within_the_bytes_and_the_head_alone(llama):
    manifest = llama.manifest
    weights = [u.weight_bytes for u in manifest.units]
    for join_bytes in (0, _layer_bytes(manifest), sum(weights)):
        cut = blocks(manifest, join_bytes)
        assert [i for first, last in cut for i in range(first, last + 1)] == list(
            range(len(weights)))
        for first, last in cut:
            assert first == last or sum(weights[first : last + 1]) <= join_bytes
            assert first == last or not any(u.sampled for u in manifest.units[first : last + 1])
    assert len(blocks(manifest, 0)) == len(weights)
    assert 1 < len(blocks(manifest, _layer_bytes(manifest))) < len(weights)
    assert blocks(manifest, sum(weights)) == ((0, len(weights) - 2),
                                              (len(weights) - 1, len(weights) - 1))


@pytest.mark.slow
def test_joined_stages_answer_bit_for_bit_as_units_alone(llama):
    manifest, directory = llama.manifest, llama.directory
    last = len(manifest.units) - 1
    answers = {}
    for name, options in (("alone", ALONE), ("by layers", ExecutorOptions(
            join_bytes=_layer_bytes(manifest))), ("default", JOINED)):
        stages = [StageExecutor(manifest, directory, 0, 4, options),
                  StageExecutor(manifest, directory, 5, last, options)]
        answers[name] = _steps(stages, ["a", "b"], 3)
    assert len(StageExecutor(manifest, directory, 5, last, JOINED).sessions) == 2, (
        "layers, then head")
    for name in ("by layers", "default"):
        for joined, alone in zip(answers[name], answers["alone"], strict=True):
            np.testing.assert_array_equal(joined, alone, err_msg=name)


def test_the_exit_reads_a_hidden_state_from_inside_a_joined_block(llama):
    manifest, directory = llama.manifest, llama.directory
    point = exit_point(manifest, 1)
    hidden = []
    for options in (ALONE, JOINED):
        stage = StageExecutor(manifest, directory, 0, 6, options, exit=point)
        assert options is ALONE or stage.session(point.unit) is stage.session(point.unit + 1)
        out = stage.step("s", {"input_ids": np.array([PROMPT]),
                               "position_ids": np.arange(len(PROMPT))[None]})
        hidden.append(stage.exit_logits(out[EXIT_HIDDEN]))
    np.testing.assert_array_equal(hidden[0], hidden[1])


def test_kv_moves_out_of_and_into_a_stage_joined_whole_unit_by_unit(llama):
    """A rebalance moves each unit's K/V on its own, whatever sessions run the units."""
    manifest, directory = llama.manifest, llama.directory
    last = len(manifest.units) - 1
    whole = ExecutorOptions(join_bytes=JOIN_WHOLE)
    assert len(StageExecutor(manifest, directory, 0, last - 1, whole).sessions) == 1
    head = StageExecutor(manifest, directory, last, last, ALONE)
    prompt = {"input_ids": np.array([PROMPT]), "position_ids": np.arange(len(PROMPT))[None]}
    decode = {"input_ids": np.array([[5]]), "position_ids": np.array([[len(PROMPT)]])}
    unmoved = StageExecutor(manifest, directory, 0, last - 1, ALONE)
    unmoved.step("s", prompt)
    expected = head.step("s", unmoved.step("s", decode))["logits"]
    for first, then in ((whole, ALONE), (ALONE, whole), (whole, whole)):
        old = StageExecutor(manifest, directory, 0, last - 1, first)
        new = StageExecutor(manifest, directory, 0, last - 1, then)
        old.step("s", prompt)
        for unit in range(last):
            new.import_state("s", unit, old.export_state("s", unit))
        moved = head.step("s", new.step("s", decode))["logits"]
        np.testing.assert_array_equal(moved, expected)


def test_a_warm_up_times_every_unit_of_a_joined_block(llama):
    manifest, directory = llama.manifest, llama.directory
    stage = StageExecutor(manifest, directory, 0, 6, JOINED)
    timed = stage.warm_up(runs=2)
    assert sorted(timed) == list(range(7)) and all(seconds > 0 for seconds in timed.values())


def test_a_new_stage_shares_the_blocks_it_keeps_whole_and_loads_a_cut_one(llama, tmp_path):
    manifest = llama.manifest
    directory = tmp_path / "units"
    shutil.copytree(llama.directory, directory)
    options = ExecutorOptions(join_bytes=_layer_bytes(manifest))
    cut = blocks(manifest, options.join_bytes)
    kept, split = cut[0], cut[1]
    assert split[0] < split[1], "a block of two units or more, to cut"
    shelf = SessionShelf()
    old = StageExecutor(manifest, directory, 0, split[1], options, shelf)
    for unit in manifest.units[kept[0] : kept[1] + 1]:  # a new stage must not open these
        for file in unit.files:
            (directory / file.name).unlink()

    new = StageExecutor(manifest, directory, 0, split[0], options, shelf)

    assert new.session(kept[0]) is old.session(kept[0])
    assert new.session(split[0]) is not old.session(split[0])
    weights = sum(u.weight_bytes for u in manifest.units[: split[1] + 1])
    assert held_bytes([old, new]) == weights + manifest.units[split[0]].weight_bytes
    fresh = StageExecutor(manifest, llama.directory, 0, split[0], options)
    request = {"input_ids": np.array([PROMPT]), "position_ids": np.arange(len(PROMPT))[None]}
    expected = fresh.step("s", request)
    for name, value in new.step("s", request).items():
        np.testing.assert_array_equal(value, expected[name])


def test_a_unit_the_shelf_runs_alone_is_not_loaded_again(llama, tmp_path):
    manifest = llama.manifest
    directory = tmp_path / "units"
    shutil.copytree(llama.directory, directory)
    shelf = SessionShelf()
    copy = shelf.session(manifest, manifest.units[2], directory / manifest.units[2].model_file.name,
                         JOINED)
    for file in manifest.units[2].files:
        (directory / file.name).unlink()

    stage = StageExecutor(manifest, directory, 0, 4, JOINED, shelf)

    assert stage.session(2) is copy
    assert stage.session(3) is stage.session(4), "the units after it still joined"


_WITHOUT_ONNX = """
import json, sys
import numpy as np
from shards.executor import ExecutorOptions, StageExecutor
from shards.joined import JOIN_BYTES
from shards.manifest import Manifest

directory, prompt = sys.argv[1], json.loads(sys.argv[2])
manifest = Manifest.load(directory)
stage = StageExecutor(manifest, directory, 0, len(manifest.units) - 1,
                      ExecutorOptions(join_bytes=JOIN_BYTES))
out = stage.step("s", {"input_ids": np.array([prompt]),
                       "position_ids": np.arange(len(prompt))[None]})
print(json.dumps({"onnx": "onnx" in sys.modules, "sessions": len(stage.sessions),
                  "logits": out["logits"][0, -1].tolist()}))
"""


@pytest.mark.slow
def test_a_process_without_onnx_joins_the_units_in_a_child_and_keeps_onnx_out(llama):
    done = subprocess.run([sys.executable, "-c", _WITHOUT_ONNX, str(llama.directory),
                           json.dumps(PROMPT)], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    alone = StageExecutor(llama.manifest, llama.directory, 0, len(llama.manifest.units) - 1,
                          ALONE)
    expected = alone.step("s", {"input_ids": np.array([PROMPT]),
                                "position_ids": np.arange(len(PROMPT))[None]})
    assert not result["onnx"] and result["sessions"] < len(llama.manifest.units)
    np.testing.assert_array_equal(np.array(result["logits"], np.float32),
                                  expected["logits"][0, -1])
