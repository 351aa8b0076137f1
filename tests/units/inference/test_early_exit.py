"""Early exit and speculative decoding (CE-CoLLM) through the in-process pipeline, checked
against transformers.

- An exit that is never confident enough (θ > 1) changes nothing.
- An exit that always is (θ = 0) gives, step by step, transformers' argmax of
  `lm_head(norm(hidden_states[N]))` for the tokens so far.
- Speculative decoding with 1 to 4 drafts gives the full model's greedy answer; sampled
  answers with drafts follow the full model's distribution (speculative sampling).
- After exits, the stages behind the exit hold the K/V of a full run of the same tokens.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats
from sharding import _transformers_model, exit_reference, logits_along, reference, sharded

from peerd.commands.generate import build_pipeline, generate
from peerd.errors import PeerdError
from peerd.inference.pipeline import Generation, drafts_wanted
from shards.early_exit import ExitSettings
from shards.sampling import SamplingParams

PROMPT = (1, 17, 42, 99, 7, 250, 3, 64)
NEW_TOKENS = 24
GREEDY = SamplingParams()
LAYERS = 4


@pytest.fixture(scope="module", params=["llama", "gpt2", "bloom"])
def model(request, hf_checkpoint):
    return hf_checkpoint(request.param, layers=LAYERS)


def _run(model_dir, parts: int, exits: ExitSettings, params: SamplingParams = GREEDY):
    result = sharded(model_dir)
    pipeline = build_pipeline(result.manifest, result.directory, parts, exits=exits)
    run = generate(pipeline, result.manifest, list(PROMPT), NEW_TOKENS, params, stop_at_eos=False)
    assert all(w.executor.sequence_count == 0 for w in pipeline.workers)
    return run


def test_an_exit_never_confident_enough_changes_nothing(model):
    tokens, _ = reference(model, PROMPT, NEW_TOKENS)
    run = _run(model, 3, ExitSettings(threshold=1.01))
    assert run.token_ids == tokens
    assert run.stats["exit"]["exited"] == 0


@pytest.mark.parametrize(("parts", "layer"), [(1, 1), (1, 3), (2, None), (3, 1)])
def test_an_always_confident_exit_answers_from_its_layer(model, parts, layer):
    run = _run(model, parts, ExitSettings(threshold=0.0, layer=layer))
    exit_layer = run.stats["exit"]["layer"]
    assert exit_layer == (layer or LAYERS // 2)
    assert run.token_ids == exit_reference(model, exit_layer, PROMPT, NEW_TOKENS)
    assert run.stats["exit"]["exited"] == NEW_TOKENS == run.stats["exit"]["checked"]


def test_exits_and_the_full_model_disagree_somewhere(model):
    """The exit is not the full model in disguise: with random weights its answer differs,
    and the agreement the stats report is what the two answers share."""
    run = _run(model, 2, ExitSettings(threshold=0.0))
    stats = run.stats["exit"]
    assert stats["agreed"] < stats["checked"] == NEW_TOKENS


@pytest.mark.parametrize("drafts", [1, 2, 3, 4])
@pytest.mark.parametrize("parts", [1, 3])
def test_speculative_decoding_gives_the_full_models_greedy_answer(model, parts, drafts):
    tokens, _ = reference(model, PROMPT, NEW_TOKENS)
    run = _run(model, parts, ExitSettings(speculative=drafts, layer=1))
    assert run.token_ids == tokens
    stats = run.stats["exit"]
    assert stats["checks"] < NEW_TOKENS  # every check gives at least one token
    assert 0 <= stats["accepted"] <= stats["drafted"]


def test_after_exits_the_later_stages_hold_the_full_models_kv(hf_checkpoint):
    model_dir = hf_checkpoint("llama", layers=LAYERS)
    result = sharded(model_dir)
    pipeline = build_pipeline(result.manifest, result.directory, 3,
                              exits=ExitSettings(threshold=0.0, layer=1))
    generation = Generation("kept", list(PROMPT), NEW_TOKENS, frozenset())
    pipeline.generate([(generation, GREEDY)], keep=True)
    assert len(generation.exits) == NEW_TOKENS
    fed = [*PROMPT, *generation.tokens[:-1]]
    with torch.no_grad():
        cache = _transformers_model(model_dir)(torch.tensor([fed])).past_key_values
    compared = 0
    for worker in pipeline.workers[1:]:
        executor = worker.executor
        for unit in executor.units:
            state = executor.export_state("kept", unit.index)
            for spec in unit.state:
                layer = int(spec.input.rsplit("_", 1)[1])
                expected = (cache.layers[layer].keys if "_k_" in spec.input
                            else cache.layers[layer].values)
                np.testing.assert_allclose(state[spec.input], expected.numpy(), atol=1e-4)
                compared += 1
    assert compared == 2 * (LAYERS - 1)  # every layer behind the exit's
    pipeline.drop("kept")


def test_bad_settings_are_refused_in_one_line(hf_checkpoint):
    result = sharded(hf_checkpoint("llama", layers=LAYERS))
    with pytest.raises(PeerdError, match="not on the first stage.*fewer --parts"):
        build_pipeline(result.manifest, result.directory, 3, exits=ExitSettings(0.5, layer=3))
    with pytest.raises(PeerdError, match="from 1 to 3"):
        build_pipeline(result.manifest, result.directory, 1, exits=ExitSettings(0.5, layer=4))
    with pytest.raises(ValueError, match="do not go together"):
        ExitSettings(0.5, speculative=2)


def test_drafts_follow_what_the_checks_kept():
    """Each check drafts one more token than the last check kept (all of --speculative
    before the first): an exit that guesses badly drafts one token a check. Sampled answers
    draft too; answers that ask log-probabilities do not."""
    settings, greedy = ExitSettings(speculative=4), GREEDY
    generation = Generation("s", [1, 2], 20, frozenset(), tokens=[5], cached=2)
    assert drafts_wanted(settings, generation, greedy) == 4
    generation.verified(0, [7, 8, 9, 10], (7, 3, 9, 10), 11)  # keeps 1 draft, then 3
    assert generation.tokens == [5, 7, 3] and drafts_wanted(settings, generation, greedy) == 2
    generation.verified(1, [4, 4], (6, 6), 6)
    assert drafts_wanted(settings, generation, greedy) == 1
    generation.verified(2, [6], (6,), 2)
    assert drafts_wanted(settings, generation, greedy) == 2
    assert drafts_wanted(settings, generation, SamplingParams(temperature=0.5)) == 2
    assert drafts_wanted(settings, generation, SamplingParams(logprobs=0)) == 0
    generation.max_tokens = len(generation.tokens) + 1
    assert drafts_wanted(settings, generation, greedy) == 0  # room for the check's own token
    generation.max_tokens = 20
    generation.restart("s2")  # a re-prefill: the head's stage has no context to draft from
    assert drafts_wanted(settings, generation, greedy) == 0


SPEC_RUNS = 600  # answers per distribution test, in batches the stages run together
SPEC_PROMPT = (1, 17, 42, 99, 7)
SPEC_SAMPLING = {"temperature": 1.0, "top_k": 3}


def _top_k_softmax(row: np.ndarray, k: int, temperature: float) -> dict[int, float]:
    """The sampled distribution of a row of logits, written out here (not shards')."""
    best = np.argsort(-row)[:k]
    weights = np.exp((row[best] - row[best].max()) / temperature)
    return {int(t): float(w) for t, w in zip(best, weights / weights.sum(), strict=True)}


def _exact_joint(model_dir) -> dict[tuple[int, ...], float]:
    """The full model's probability of each first three tokens, sampled with SPEC_SAMPLING,
    from transformers' logits given the tokens before each."""
    k, temperature = SPEC_SAMPLING["top_k"], SPEC_SAMPLING["temperature"]
    start = len(SPEC_PROMPT) - 1
    joint: dict[tuple[int, ...], float] = {}
    first = _top_k_softmax(logits_along(model_dir, SPEC_PROMPT)[start], k, temperature)
    for t1, p1 in first.items():
        second = _top_k_softmax(logits_along(model_dir, (*SPEC_PROMPT, t1))[start + 1], k,
                                temperature)
        for t2, p2 in second.items():
            rows = logits_along(model_dir, (*SPEC_PROMPT, t1, t2))
            for t3, p3 in _top_k_softmax(rows[start + 2], k, temperature).items():
                joint[(t1, t2, t3)] = p1 * p2 * p3
    return joint


def _sampled_answers(model_dir, exits: ExitSettings) -> list[Generation]:
    """SPEC_RUNS answers of 4 tokens, seeds 0.. , through two stages."""
    result = sharded(model_dir)
    pipeline = build_pipeline(result.manifest, result.directory, 2, exits=exits)
    answers = [Generation(f"seed{seed}", list(SPEC_PROMPT), 4, frozenset())
               for seed in range(SPEC_RUNS)]
    for first in range(0, SPEC_RUNS, 200):
        pipeline.generate([(answer, SamplingParams(**SPEC_SAMPLING, seed=seed))
                           for seed, answer in enumerate(answers[first : first + 200], first)])
    return answers


def _chi_square_p(answers: list[Generation], joint: dict[tuple[int, ...], float]) -> float:
    """The chi-square test's p-value of the answers' first three tokens against `joint`,
    cells expecting fewer than 5 answers pooled; every answer within the joint's support."""
    counts = Counter(tuple(a.tokens[:3]) for a in answers)
    assert set(counts) <= set(joint), set(counts) - set(joint)
    observed, expected, pooled = [], [], [0, 0.0]
    for cell, probability in joint.items():
        if probability * len(answers) >= 5:
            observed.append(counts[cell])
            expected.append(probability * len(answers))
        else:
            pooled[0] += counts[cell]
            pooled[1] += probability * len(answers)
    if pooled[1] > 0:
        observed.append(pooled[0])
        expected.append(pooled[1])
    scale = len(answers) / sum(expected)  # the joint sums to 1 up to rounding
    return float(stats.chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.mark.parametrize("drafts", [0, 2])
def test_sampled_speculative_answers_follow_the_full_models_distribution(hf_checkpoint,
                                                                         drafts):
    """Speculative sampling: over 600 seeds, the first three tokens of a sampled answer
    (the 2nd and 3rd drafted by the exit and checked together) are distributed as the full
    model samples them, from transformers' logits, as without drafts (0: the control). A
    p-value below 0.001 fails; the seeds are fixed, so the outcome is too. The exit is
    random-weighted, so drafts are both kept and replaced."""
    model_dir = hf_checkpoint("llama", layers=2)
    answers = _sampled_answers(model_dir, ExitSettings(speculative=drafts, layer=1)
                               if drafts else ExitSettings())
    assert _chi_square_p(answers, _exact_joint(model_dir)) > 1e-3
    if drafts:
        drafted = sum(a.drafted for a in answers)
        accepted = sum(a.accepted for a in answers)
        assert sum(a.checks for a in answers) >= SPEC_RUNS  # the 2nd token is always checked
        assert 0 < accepted < drafted
