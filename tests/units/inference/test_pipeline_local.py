"""The data plane's stage logic, run in one process over the toy units, through the codec."""

import numpy as np
import pytest
from toy_units import ToyModel

from peerd.inference.local_pipeline import LocalPipeline
from peerd.inference.pipeline import Generation, StageWorker
from peerd.inference.routing import routes
from peerd.wire.protocol import StageData, draft_probs
from shards.executor import StageExecutor
from shards.sampling import Distribution, SamplingParams

SPLITS = {1: [(0, 2)], 2: [(0, 0), (1, 2)], 3: [(0, 0), (1, 1), (2, 2)]}


def _pipeline(toy, parts: int, fp16_wire: bool = False) -> LocalPipeline:
    _, manifest, directory = toy
    ranges = SPLITS[parts]
    return LocalPipeline(
        [
            StageWorker(s, StageExecutor(manifest, directory, a, b), r, fp16_wire)
            for s, ((a, b), r) in enumerate(zip(ranges, routes(manifest, ranges), strict=True))
        ]
    )


def _reference_greedy(model: ToyModel, prompt: list[int], count: int) -> list[int]:
    ids = list(prompt)
    for _ in range(count):
        ids.append(int(np.argmax(model.logits(ids)[-1])))
    return ids[len(prompt):]


PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 0]]


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_interleaved_greedy_generations_equal_the_reference_at_every_split(toy, parts):
    model = toy[0]
    pipeline = _pipeline(toy, parts)
    generations = [Generation(f"s{i}", p, 12, frozenset()) for i, p in enumerate(PROMPTS)]
    pipeline.generate((g, SamplingParams()) for g in generations)
    for generation in generations:
        assert generation.tokens == _reference_greedy(model, generation.prompt, 12)
    assert all(w.executor.sequence_count == 0 for w in pipeline.workers)


def test_generation_stops_at_a_stop_token_and_includes_it(toy):
    model = toy[0]
    expected = _reference_greedy(model, [1, 2, 3], 12)
    stop = expected[4]
    generation = Generation("s", [1, 2, 3], 12, frozenset({stop}))
    _pipeline(toy, 3).generate([(generation, SamplingParams())])
    assert generation.tokens == expected[: expected.index(stop) + 1]


def test_seeded_sampling_is_the_same_at_every_split_and_depends_on_the_seed(toy):
    def sample(parts: int, seed: int) -> list[int]:
        generation = Generation("s", [1, 2], 16, frozenset())
        params = SamplingParams(temperature=1.5, top_k=8, top_p=0.95, seed=seed)
        _pipeline(toy, parts).generate([(generation, params)])
        return generation.tokens

    runs = {parts: sample(parts, seed=7) for parts in (1, 2, 3)}
    assert runs[1] == runs[2] == runs[3]
    assert sample(3, seed=8) != runs[3]


def test_residuals_travel_directly_and_only_to_their_consumers(toy):
    pipeline = _pipeline(toy, 3)
    generation = Generation("s", [1, 2, 3], 5, frozenset())
    pipeline.generate([(generation, SamplingParams())])
    head, middle, last = (w.counters for w in pipeline.workers)
    # bias (1 float per token) goes from the head straight to the last stage, every step
    assert head.residual_bytes_by_target == {2: 4 * (3 + 4)}
    assert middle.residual_bytes == 0 and last.residual_bytes == last.sequential_bytes == 0


def test_float16_wire_halves_activation_bytes_and_keeps_the_greedy_answer(toy):
    exact = _pipeline(toy, 3)
    half = _pipeline(toy, 3, fp16_wire=True)
    runs = []
    for pipeline in (exact, half):
        generation = Generation("s", [1, 2, 3], 8, frozenset())
        pipeline.generate([(generation, SamplingParams())])
        runs.append(generation.tokens)
    assert runs[0] == runs[1]
    half_bytes, exact_bytes = (p.workers[0].counters.sequential_bytes for p in (half, exact))
    assert half_bytes * 2 == exact_bytes


def test_a_message_from_an_unexpected_stage_or_with_wrong_tensors_is_refused(toy):
    """Also drafts a stage's vocabulary does not hold."""
    pipeline = _pipeline(toy, 3)
    last = pipeline.workers[2]
    with pytest.raises(ValueError, match="expects nothing from stage 2"):
        last.accept(2, StageData("local", "s", 0, {}))
    with pytest.raises(ValueError, match="sent"):
        last.accept(1, StageData("local", "s", 0, {"bias": np.zeros((1, 1, 1), np.float32)}))
    vocab = toy[1].model.vocab_size
    beyond = draft_probs([vocab], [Distribution(np.int32([vocab]), np.float32([1.0]))])
    with pytest.raises(ValueError, match=f"beyond the vocabulary \\({vocab} tokens\\)"):
        last.accept(1, StageData("local", "s", 0, {"hidden1": np.zeros((1, 2, 4), np.float32)},
                                 rows=2, draft_probs=beyond))


def test_a_restarted_generation_re_prefills_and_continues_exactly(toy):
    model = toy[0]
    generation = Generation("s", [1, 2, 3], 5, frozenset())
    _pipeline(toy, 3).generate([(generation, SamplingParams())])
    generation.max_tokens = 12
    generation.restart("s-again")
    step = generation.next_step()
    assert step.step == 0 and step.inputs["input_ids"].tolist() == [[1, 2, 3, *generation.tokens]]
    _pipeline(toy, 2).generate([(generation, SamplingParams())])
    assert generation.tokens == _reference_greedy(model, [1, 2, 3], 12)
