"""Several sequences in one step: each gets what it gets alone, whatever joins or leaves."""

from __future__ import annotations

import numpy as np
import pytest
from sharding import sharded

from shards.executor import StageExecutor

PROMPTS = {"a": [1, 17, 42, 99, 7, 250], "b": [5, 6], "c": [9, 81, 3, 3, 12, 40, 77, 2, 1]}


@pytest.fixture(scope="module")
def llama(hf_checkpoint):
    return sharded(hf_checkpoint("llama"))


def _stages(result, cuts=(2, 5)) -> list[StageExecutor]:
    last = len(result.manifest.units) - 1
    bounds = [0, *cuts, last + 1]
    return [StageExecutor(result.manifest, result.directory, first, end - 1)
            for first, end in zip(bounds, bounds[1:], strict=False)]


def _request(tokens: list[int], start: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.array([tokens[start:]], np.int64),
            "position_ids": np.arange(start, len(tokens))[None]}


def _forward(stages, steps: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One pass of every sequence in `steps` through the stages, all of them in each call."""
    values = {seq_id: dict(inputs) for seq_id, inputs in steps.items()}
    for stage in stages:
        order = list(values)
        outputs = stage.step_many([(s, {n: values[s][n] for n in stage.inputs}) for s in order])
        for seq_id, produced in zip(order, outputs, strict=True):
            values[seq_id].update(produced)
    return {seq_id: v["logits"][0, -1] for seq_id, v in values.items()}


def _alone(stages, prompt: list[int], count: int) -> list[np.ndarray]:
    """The logits of each step of a greedy answer run on its own."""
    tokens, rows = list(prompt), []
    for _ in range(count):
        start = len(tokens) - 1 if rows else 0
        rows.append(_forward(stages, {"x": _request(tokens, start)})["x"])
        tokens.append(int(np.argmax(rows[-1])))
    for stage in stages:
        stage.drop("x")
    return rows


def _together(stages, schedule: list[set[str]]) -> dict[str, list[np.ndarray]]:
    """Greedy answers of PROMPTS where step i runs the sequences in schedule[i] together; a
    sequence missing from a step waits (and leaves the batch it was in)."""
    tokens = {seq_id: list(prompt) for seq_id, prompt in PROMPTS.items()}
    rows: dict[str, list[np.ndarray]] = {seq_id: [] for seq_id in PROMPTS}
    for running in schedule:
        steps = {s: _request(tokens[s], len(tokens[s]) - 1 if rows[s] else 0) for s in running}
        for seq_id, logits in _forward(stages, steps).items():
            rows[seq_id].append(logits)
            tokens[seq_id].append(int(np.argmax(logits)))
    return rows


def _assert_same(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert np.argmax(a) == np.argmax(b), step
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "mistral", "bloom", "gpt2"])
def test_sequences_of_different_lengths_decode_together_as_they_would_alone(
        hf_checkpoint, family):
    stages = _stages(sharded(hf_checkpoint(family)))
    schedule = [{"a"}, {"b"}, {"c"}, *[{"a", "b", "c"}] * 6]
    together = _together(stages, schedule)
    for seq_id, prompt in PROMPTS.items():
        _assert_same(together[seq_id], _alone(stages, prompt, 7))


def test_answers_joining_and_leaving_the_batch_keep_their_own_answers(llama):
    stages = _stages(llama)
    schedule = [{"a", "c"}, {"a"}, {"a", "c", "b"}, {"b", "c"}, {"a", "b", "c"}, {"c", "a"},
                {"b"}, {"a", "b", "c"}]
    together = _together(stages, schedule)
    for seq_id, prompt in PROMPTS.items():
        _assert_same(together[seq_id], _alone(stages, prompt, len(together[seq_id])))


def test_a_batched_sequence_moves_with_its_own_k_v_and_drops_alone(llama):
    stages = _stages(llama)
    _together(stages, [{"a"}, {"b"}, {"a", "b"}, {"a", "b"}])
    middle = stages[1]
    per_token = sum(u.kv_bytes_per_token for u in middle.units)
    lengths = {"a": len(PROMPTS["a"]) + 2, "b": len(PROMPTS["b"]) + 2}
    padded = 2 * max(lengths.values())  # the last step's batch, as it came out
    assert middle.sequence_count == 2 and middle.kv_bytes() == padded * per_token
    moved = middle.export_state("b", middle.first)
    assert all(t.shape[2] == lengths["b"] for t in moved.values())
    assert middle.kv_bytes() == (lengths["a"] + lengths["b"]) * per_token
    middle.drop("a")
    assert middle.sequence_count == 1 and middle.kv_bytes() == lengths["b"] * per_token


def test_a_bad_step_fails_alone(llama):
    stage = _stages(llama)[1]
    good = _stages(llama)[0].step_many([(s, _request(PROMPTS[s], 0)) for s in ("a", "b")])
    inputs = [{n: out[n] for n in stage.inputs} for out in good]
    hidden = next(name for name in stage.inputs if name.endswith(".hidden"))
    wrong = {**inputs[1], hidden: inputs[1][hidden][..., :-1]}
    outcomes = stage.step_many([("a", inputs[0]), ("b", wrong), ("a", inputs[0])])
    assert isinstance(outcomes[0], dict) and set(outcomes[0]) == set(stage.outputs)
    assert isinstance(outcomes[1], Exception)
    assert isinstance(outcomes[2], ValueError) and "earlier in this batch" in str(outcomes[2])
    assert stage.sequence_count == 1


@pytest.mark.parametrize("length", [len(PROMPTS["c"]), 4])
def test_a_forked_sequence_continues_as_a_fresh_run_of_its_whole_context(llama, length):
    stages = _stages(llama)
    follow_up = [*PROMPTS["c"], 5, 8, 13]
    fresh = _forward(stages, {"fresh": _request(follow_up, 0)})["fresh"]
    _forward(stages, {"old": _request(PROMPTS["c"], 0)})
    for stage in stages:
        stage.fork("old", "new", length)
    forked = _forward(stages, {"new": _request(follow_up, length)})["new"]
    np.testing.assert_allclose(forked, fresh, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="holds 9 positions"):
        stages[0].fork("old", "other", 10)
    with pytest.raises(KeyError, match="unknown sequence"):
        stages[0].fork("gone", "other", 1)


def test_the_head_runs_on_the_rows_whose_tokens_are_drawn(llama):
    """Given a sequence's `rows`, the last stage's logits are those rows' alone, as a step
    over every row gives them; steps asking for different rows run and answer apart."""
    first, last = _stages(llama, cuts=(len(llama.manifest.units) - 1,))
    hidden = {s: first.step_many([(s, _request(PROMPTS[s], 0))])[0] for s in ("a", "c")}
    full = {s: last.step(s + "-full", {n: hidden[s][n] for n in last.inputs})["logits"]
            for s in hidden}
    outcomes = last.step_many([(s, {n: hidden[s][n] for n in last.inputs}) for s in hidden],
                              rows={"a": 1, "c": 3})
    for (seq_id, wanted), outcome in zip({"a": 1, "c": 3}.items(), outcomes, strict=True):
        assert isinstance(outcome, dict)
        assert outcome["logits"].shape == (1, wanted, full[seq_id].shape[2])
        np.testing.assert_allclose(outcome["logits"], full[seq_id][:, -wanted:], atol=1e-5,
                                   rtol=0)
