"""The stage executor on real exported units: K/V accounting, and no torch in its process."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from sharding import sharded

from peerd.commands.generate import build_pipeline, generate
from shards.executor import StageExecutor
from shards.sampling import SamplingParams

PROMPT = [1, 17, 42, 99, 7, 250]


@pytest.fixture(scope="module")
def llama(hf_checkpoint):
    return sharded(hf_checkpoint("llama"))


@pytest.mark.slow
def test_kv_bytes_follow_the_manifest_and_drop_frees_them(llama):
    manifest, directory = llama.manifest, llama.directory
    stage = StageExecutor(manifest, directory, 1, 3)
    per_token = sum(u.kv_bytes_per_token for u in manifest.units[1:4])
    head = StageExecutor(manifest, directory, 0, 0)
    for seq_id, length in (("a", 6), ("b", 2)):
        request = {"input_ids": np.ones((1, length), np.int64),
                   "position_ids": np.arange(length)[None]}
        stage.step(seq_id, head.step(seq_id, request))
    assert stage.sequence_count == 2 and stage.kv_bytes() == (6 + 2) * per_token
    moved = stage.export_state("a", 1)
    assert set(moved) == {"past_k_0", "past_v_0"} and moved["past_k_0"].shape[2] == 6
    stage.drop("a")
    assert stage.sequence_count == 1 and stage.kv_bytes() == 2 * per_token


_TORCH_FREE = """
import json, sys
import numpy as np
from shards.executor import StageExecutor
from shards.manifest import Manifest
from shards.sampling import Sampler, SamplingParams

directory, prompt, count = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
manifest = Manifest.load(directory)
last = len(manifest.units) - 1
stages = [StageExecutor(manifest, directory, 0, 1), StageExecutor(manifest, directory, 2, last)]
sampler = Sampler(SamplingParams(temperature=0.8, top_k=40, seed=3))
ids, tokens = prompt, []
for _ in range(count):
    start = len(prompt) + len(tokens) - len(ids)
    positions = np.arange(start, start + len(ids))[None]
    values = {"input_ids": np.array([ids]), "position_ids": positions}
    for stage in stages:
        values.update(stage.step("s", {name: values[name] for name in stage.inputs}))
    tokens.append(sampler(values["logits"][0, -1]))
    ids = tokens[-1:]
print(json.dumps({"tokens": tokens, "torch": "torch" in sys.modules}))
"""


def test_a_process_that_only_executes_units_never_imports_torch(llama):
    params = SamplingParams(temperature=0.8, top_k=40, seed=3)
    expected = generate(build_pipeline(llama.manifest, llama.directory, 2), llama.manifest,
                        PROMPT, 12, params, stop_at_eos=False).token_ids
    out = subprocess.run(
        [sys.executable, "-c", _TORCH_FREE, str(llama.directory), json.dumps(PROMPT), "12"],
        capture_output=True, text=True, check=True, timeout=120,
    )
    result = json.loads(out.stdout)
    assert result["torch"] is False
    assert result["tokens"] == expected


_LONG_PROMPT = """
import sys
import numpy as np
import psutil
from shards.executor import StageExecutor
from shards.manifest import Manifest

directory, length = sys.argv[1], int(sys.argv[2])
manifest = Manifest.load(directory)
stage = StageExecutor(manifest, directory, 0, len(manifest.units) - 1)


def prefill(seq_id, tokens):
    request = {"input_ids": np.full((1, tokens), 5), "position_ids": np.arange(tokens)[None]}
    stage.step(seq_id, request, rows=1)
    stage.drop(seq_id)


prefill("warm", 8)
before = psutil.Process().memory_info().rss
prefill("long", length)
print(psutil.Process().memory_info().rss - before)
"""


@pytest.mark.slow
def test_a_long_prompt_leaves_no_arena_behind(hf_checkpoint):
    """The process's arena holds a prefill's activations (its attention scores, heads x
    length x length floats per layer) while the step runs, and hands them back when the step
    ends: once the sequence is dropped, resident memory is back within one scores tensor."""
    length, heads = 2048, 4
    model = sharded(hf_checkpoint("llama", heads=heads, max_position_embeddings=length))
    out = subprocess.run(
        [sys.executable, "-c", _LONG_PROMPT, str(model.directory), str(length)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    scores = heads * length * length * 4
    assert int(out.stdout) < scores


_SHARED_POOL = """
import json, sys
import numpy as np
import onnxruntime as ort
from peerd.cluster.benchmark import calibration_session
from shards.executor import ExecutorOptions, StageExecutor, session_options
from shards.manifest import Manifest

directory, prompt = sys.argv[1], json.loads(sys.argv[2])
manifest = Manifest.load(directory)
request = {"input_ids": np.array([prompt]), "position_ids": np.arange(len(prompt))[None]}
last = len(manifest.units) - 1
own = StageExecutor(manifest, directory, 0, last).step("s", request)["logits"]
shared = StageExecutor(manifest, directory, 0, last, ExecutorOptions(shared_pool=True))
pooled = shared.step("s", request)["logits"]
unit = f"{directory}/{manifest.units[1].model_file.name}"
ort.InferenceSession(unit, session_options(), providers=["CPUExecutionProvider"])
calibration_session(64, 2)
print(json.dumps({"max_difference": float(np.abs(own - pooled).max()),
                  "same_argmax": bool((own.argmax(-1) == pooled.argmax(-1)).all())}))
"""


def test_the_shared_pool_computes_the_same_and_later_sessions_run_on_it(llama):
    """In its own process: once the shared pool exists ONNX Runtime refuses sessions with
    pools of their own, so every session peerd builds after it (an export's load check, the
    calibration graph) must take it, and the units' results must not change."""
    out = subprocess.run(
        [sys.executable, "-c", _SHARED_POOL, str(llama.directory), json.dumps(PROMPT)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["same_argmax"] and result["max_difference"] < 1e-5
