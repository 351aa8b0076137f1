"""Our architectures against Hugging Face transformers on random checkpoints saved to disk:
fp32 logits within 1e-4 for a prefill and for decode steps through the explicit KV cache,
and greedy generation token-for-token."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from checkpoints import FAMILIES

from shards.arch import build_model, empty_cache
from shards.arch.rope import inverse_frequencies
from shards.checkpoint import load_model

# longer than the "mistral" fixture's sliding window (12)
PROMPT = [1, 40, 41, 99, 120, 7, 8, 200, 33, 250, 61, 5, 17, 300, 18, 42]
DECODE_STEPS = 6
NEW_TOKENS = 40

VARIANTS = [(family, {}) for family in FAMILIES] + [
    ("llama", {"dtype": "float16"}),
    ("llama", {"dtype": "bfloat16"}),
    ("qwen2", {"dtype": "bfloat16"}),
    ("gpt2", {"dtype": "float16"}),
    ("bloom", {"dtype": "bfloat16"}),
    ("llama", {"max_shard_size": "40KB"}),
    ("bloom", {"max_shard_size": "40KB", "layers": 3}),
]
IDS = [family + "".join(f"-{v}" for v in options.values()) for family, options in VARIANTS]


def hf_model(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def positions(start: int, count: int) -> torch.Tensor:
    return torch.arange(start, start + count)[None]


@torch.inference_mode()
def greedy(model, config, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding with our model: one prefill, then one token per step via the cache."""
    logits, *past = model(torch.tensor([prompt]), positions(0, len(prompt)), *empty_cache(config))
    tokens = []
    for step in range(new_tokens):
        tokens.append(int(logits[0, -1].argmax()))
        next_ids = torch.tensor([[tokens[-1]]])
        logits, *past = model(next_ids, positions(len(prompt) + step, 1), *past)
    return tokens


@pytest.mark.parametrize(("family", "options"), VARIANTS, ids=IDS)
def test_prefill_and_decode_logits_match_transformers(hf_checkpoint, family, options):
    model_dir = hf_checkpoint(family, **options)
    config, model = load_model(model_dir)
    total = len(PROMPT) + DECODE_STEPS
    ids = torch.tensor([PROMPT + [(7 * i + 3) % config.vocab_size for i in range(DECODE_STEPS)]])
    with torch.inference_mode():
        reference = hf_model(model_dir)(ids).logits
        prompt = ids[:, : len(PROMPT)]
        logits, *past = model(prompt, positions(0, len(PROMPT)), *empty_cache(config))
        steps = [logits]
        for t in range(len(PROMPT), total):
            logits, *past = model(ids[:, t : t + 1], positions(t, 1), *past)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), reference, atol=1e-4, rtol=0)
    assert [tuple(p.shape) for p in past] == [
        (1, config.num_kv_heads, total, config.head_dim)
    ] * (2 * config.num_layers)


@pytest.mark.parametrize(("family", "options"), VARIANTS, ids=IDS)
def test_greedy_generation_matches_transformers(hf_checkpoint, family, options):
    model_dir = hf_checkpoint(family, **options)
    config, model = load_model(model_dir)
    expected = hf_model(model_dir).generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
    )[0, len(PROMPT):].tolist()
    assert len(expected) == NEW_TOKENS
    assert greedy(model, config, PROMPT, NEW_TOKENS) == expected


def test_chunked_prefill_equals_one_prefill(hf_checkpoint):
    """A prompt fed in chunks through the cache gives the logits of one prefill."""
    config, model = load_model(hf_checkpoint("llama"))
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        whole = model(ids, positions(0, len(PROMPT)), *empty_cache(config))[0]
        first, *past = model(ids[:, :5], positions(0, 5), *empty_cache(config))
        rest = model(ids[:, 5:], positions(5, len(PROMPT) - 5), *past)[0]
    torch.testing.assert_close(torch.cat((first, rest), dim=1), whole, atol=1e-5, rtol=0)


def test_mistral_window_is_exercised(hf_checkpoint):
    """The sliding window hides keys in these tests: dropping it changes the logits."""
    config, model = load_model(hf_checkpoint("mistral"))
    window = config.window(0)
    assert window is not None and window < len(PROMPT)
    unwindowed = build_model(dataclasses.replace(config, layer_windows=()))
    unwindowed.load_state_dict(model.state_dict())
    ids, pos = torch.tensor([PROMPT]), positions(0, len(PROMPT))
    with torch.inference_mode():
        windowed_logits = model(ids, pos, *empty_cache(config))[0]
        full_logits = unwindowed(ids, pos, *empty_cache(config))[0]
    torch.testing.assert_close(windowed_logits[:, :window], full_logits[:, :window])
    assert not torch.allclose(windowed_logits[:, window:], full_logits[:, window:], atol=1e-3)


@pytest.mark.parametrize("family", ["llama3-rope-scaling", "llama-rope-linear"])
def test_rope_scaling_changes_frequencies(hf_checkpoint, family):
    config, _ = load_model(hf_checkpoint(family))
    plain = dataclasses.replace(config, rope_scaling=None)
    assert not torch.allclose(inverse_frequencies(config), inverse_frequencies(plain))


def test_dynamic_rope_matches_transformers_beyond_max_positions(hf_checkpoint):
    """Dynamic NTK scaling only acts past max_positions, so decode runs past it."""
    model_dir = hf_checkpoint(
        "llama",
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        max_position_embeddings=12,
    )
    config, model = load_model(model_dir)
    assert config.max_positions < len(PROMPT)
    expected = hf_model(model_dir).generate(
        torch.tensor([PROMPT[:8]]), max_new_tokens=16, do_sample=False, eos_token_id=None
    )[0, 8:].tolist()
    assert greedy(model, config, PROMPT[:8], 16) == expected
