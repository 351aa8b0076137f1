"""`peerd generate`, run as the real command in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sharding import reference, sharded, state_dir

from peerd.commands.generate import build_pipeline, generate
from shards.manifest import Quant
from shards.sampling import SamplingParams
from shards.tokenizer import Tokenizer

PROMPT = (1, 17, 42, 99, 7, 250, 3, 64)


def _peerd(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PEERD_STATE_DIR": str(state_dir())}
    return subprocess.run(
        [sys.executable, "-m", "peerd", *args], capture_output=True, text=True, env=env,
        timeout=300,
    )


def _generate_json(model_dir, *args: str) -> dict:
    done = _peerd("generate", str(model_dir), "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "parts"), [("llama", 3), ("bloom", 6), ("gpt2", 2)])
def test_greedy_cli_equals_transformers_generate(hf_checkpoint, family, parts):
    model_dir = hf_checkpoint(family)
    sharded(model_dir)
    ids = ",".join(map(str, PROMPT))
    out = _generate_json(model_dir, "--prompt-ids", ids, "--parts", str(parts),
                         "--max-tokens", "40")
    tokens, _ = reference(model_dir, PROMPT, 40, stop_at_eos=True)
    assert out["token_ids"] == tokens
    assert out["stats"]["parts"] == parts and len(out["stats"]["stages"]) == parts
    assert out["stats"]["generated_tokens"] == len(tokens)
    assert out["stats"]["wire_bytes"] > 0 and not out["stats"]["sharded_now"]


def test_text_prompt_goes_through_the_chat_template(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    sharded(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    by_text = _generate_json(model_dir, "--prompt", "hello world", "--max-tokens", "8")
    ids = ",".join(map(str, tokenizer.prompt_ids("hello world")))
    by_ids = _generate_json(model_dir, "--prompt-ids", ids, "--max-tokens", "8")
    assert by_text["token_ids"] == by_ids["token_ids"]
    whole = tokenizer.decode(by_text["token_ids"])  # an answer cut inside a character
    assert whole.startswith(by_text["text"])        # ends before it, as the daemon streams
    assert set(whole[len(by_text["text"]):]) <= {"\ufffd"}


def test_seeded_sampling_from_the_cli_repeats_at_any_split(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    sharded(model_dir)
    args = ("--prompt-ids", "5,6,7", "--temperature", "0.9", "--top-p", "0.9", "--seed", "4",
            "--max-tokens", "24")
    runs = [_generate_json(model_dir, *args, "--parts", parts)["token_ids"]
            for parts in ("1", "1", "6")]
    assert runs[0] == runs[1] == runs[2]


def test_sampled_speculative_decoding_from_the_cli_repeats(hf_checkpoint):
    """--speculative with a temperature: the exit drafts, and a seed gives the same answer."""
    model_dir = hf_checkpoint("llama")
    sharded(model_dir)
    args = ("--prompt-ids", "5,6,7", "--temperature", "0.9", "--seed", "4", "--max-tokens",
            "24", "--parts", "2", "--speculative", "2")
    runs = [_generate_json(model_dir, *args) for _ in range(2)]
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    assert len(runs[0]["token_ids"]) > 1 and runs[0]["stats"]["exit"]["drafted"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--prompt-ids", "1,2", "--parts", "0"), "--parts must be between 1 and 6"),
        (("--prompt-ids", "1,2", "--parts", "7"), "--parts must be between 1 and 6"),
        (("--prompt-ids", "1,99999"), "prompt token ids must be in 0..383"),
        (("--prompt-ids", "1,2", "--max-tokens", "300"), "exceed the model's 256 positions"),
        (("--prompt-ids", "1,2", "--temperature", "-1"), "temperature must be"),
        (("--prompt-ids", "1,2", "--exit-layer", "1"), "--exit-layer places the exit"),
        (("--prompt-ids", "1,2", "--early-exit", "0.5", "--speculative", "2"),
         "do not go together"),
        (("--prompt-ids", "1,2", "--early-exit", "0.5", "--exit-layer", "2"),
         "the exit layer must be from 1 to 1"),
        (("--prompt-ids", "1,2", "--early-exit", "0.5", "--parts", "6"),
         "holds no whole decoder layer"),
        (("--prompt-ids", "1,2", "--speculative", "17"), "--speculative must be from 0 to 16"),
        (("--prompt-ids", "1,2", "--tensor-parallel", "0"),
         "--tensor-parallel must be at least 1, not 0"),
        (("--prompt-ids", "1,2", "--tensor-parallel", "3"),
         "--tensor-parallel 3: 3 shares exceed the 2 KV-head groups of a layer"),
        (("--prompt-ids", "1,2", "--tensor-parallel", "2", "--early-exit", "0.5"),
         "--tensor-parallel does not run with --early-exit or --speculative yet"),
        (("--prompt-ids", "1,2", "--tensor-parallel", "2", "--quant", "int8"),
         "--tensor-parallel exports float32 share units: drop --quant"),
    ],
)
def test_bad_requests_end_with_a_one_line_reason(hf_checkpoint, args, message):
    model_dir = hf_checkpoint("llama")
    sharded(model_dir)
    done = _peerd("generate", str(model_dir), *args)
    assert done.returncode == 1
    assert done.stderr.startswith("peerd: ") and message in done.stderr
    assert done.stderr.count("\n") == 1


def test_text_prompt_without_a_tokenizer_is_refused_before_any_work(hf_checkpoint):
    done = _peerd("generate", str(hf_checkpoint("llama", tokenizer=False)), "--prompt", "hi")
    assert done.returncode == 1 and "no tokenizer" in done.stderr


@pytest.mark.parametrize("flags", [("--int8",), ("--quant", "int8"), ("--quant", "int8", "--int8")])
def test_int8_generation_uses_the_int8_units(hf_checkpoint, flags):
    model_dir = hf_checkpoint("llama")
    int8 = sharded(model_dir, Quant.INT8)
    out = _generate_json(model_dir, "--prompt-ids", "1,2,3", *flags, "--parts", "2",
                         "--max-tokens", "16")
    pipeline = build_pipeline(int8.manifest, int8.directory, 1)
    expected = generate(pipeline, int8.manifest, [1, 2, 3], 16, SamplingParams()).token_ids
    assert out["token_ids"] == expected and not out["stats"]["sharded_now"]
    assert out["stats"]["quant"] == "int8"


def test_int4_generation_is_the_same_at_any_split(hf_checkpoint):
    """Every split runs the same int4 units with the same arithmetic: the same tokens."""
    model_dir = hf_checkpoint("llama")
    sharded(model_dir, Quant.INT4)
    ids = ",".join(map(str, PROMPT))
    runs = [_generate_json(model_dir, "--prompt-ids", ids, "--quant", "int4", "--parts", parts,
                           "--max-tokens", "40")
            for parts in ("1", "2", "3")]
    assert runs[0]["token_ids"] == runs[1]["token_ids"] == runs[2]["token_ids"]
    assert {r["stats"]["quant"] for r in runs} == {"int4"}
    assert [len(r["stats"]["stages"]) for r in runs] == [1, 2, 3]
    float32, _ = reference(model_dir, PROMPT, 40, stop_at_eos=True)
    assert runs[0]["token_ids"] != float32, "these are the int4 units, not float32's"


@pytest.mark.parametrize("command", ["generate", "shard", "start"])
def test_quant_int4_with_the_int8_alias_is_a_usage_error(hf_checkpoint, command):
    model = ["--model", "m"] if command == "start" else ["m"]
    done = _peerd(command, *model, "--quant", "int4", "--int8")
    assert done.returncode == 2
    assert "error: --int8 conflicts with --quant int4" in done.stderr


@pytest.mark.slow
def test_tensor_parallel_cli_equals_transformers_and_says_the_shares(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    sharded(model_dir)
    done = _peerd("generate", str(model_dir), "--json", "--prompt-ids",
                  ",".join(map(str, PROMPT)), "--tensor-parallel", "2", "--parts", "2",
                  "--max-tokens", "12")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    tokens, _ = reference(model_dir, PROMPT, 12, stop_at_eos=True)
    assert out["token_ids"] == tokens
    stats = out["stats"]
    assert stats["tensor_parallel"] == 2 and len(stats["stages"]) == 2
    assert [s["kv_heads"] for s in stats["shares"]] == [[0, 1], [1, 2]]
    assert [s["heads"] for s in stats["shares"]] == [[0, 2], [2, 4]]
    assert stats["share_wire_bytes"] > 0
    assert "2 tensor-parallel shares per stage: share 0: heads 0-1 (KV heads 0-0)" in done.stderr
