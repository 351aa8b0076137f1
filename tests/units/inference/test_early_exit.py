"""Early exit and speculative decoding (CE-CoLLM) through the in-process pipeline, checked
against transformers.

- An exit that is never confident enough (θ > 1) changes nothing.
- An exit that always is (θ = 0) gives, step by step, transformers' argmax of
  `lm_head(norm(hidden_states[N]))` for the tokens so far.
- Speculative decoding with 1 to 4 drafts gives the full model's greedy answer.
- After exits, the stages behind the exit hold the K/V of a full run of the same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sharding import _transformers_model, exit_reference, reference, sharded

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
    generation = Generation("s", [1, 2], 20, frozenset(), tokens=[5])
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
