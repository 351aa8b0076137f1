"""Units past protobuf's 2 GiB: Qwen2.5-7B's embedding width, sharded, loaded and run.

Writes a random one-layer Llama-format checkpoint with Qwen2.5-7B's vocabulary and width
(vocab 152064 x hidden 3584: 2.18 GB of float32 each for the embedding and the LM head; a
small MLP), runs the real `peerd shard --json`, then loads its embed and head units, each in
a fresh process as a peer does (`StageExecutor`), runs one 3-token step, compares the outputs
with numpy on the checkpoint's weights, and prints each unit's files and the process's memory.
Needs about 8 GB of memory, 12 GB of disk and several minutes; not part of the tests.

    .venv/bin/python -m bench.big_unit [--quant none|int8|int4] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.llama_checkpoint import LlamaShape, write_llama
from shards.manifest import Quant

QWEN_7B_WIDTH = LlamaShape(layers=1, hidden=3584, intermediate=512, heads=28, kv_heads=4,
                           vocab=152064)
MB = 1024 * 1024
IDS = [[5, 151000, 42]]


def main() -> None:
    args = _parser().parse_args()
    if args.load:
        print(json.dumps(_load_and_run(Path(args.load[0]), int(args.load[1]))))
        return
    with tempfile.TemporaryDirectory(prefix="peerd-big-unit-", dir=args.work) as work:
        model_dir = write_llama(Path(work) / "model", QWEN_7B_WIDTH, dtype="float16")
        command = [sys.executable, "-m", "peerd", "shard", str(model_dir),
                   "--out", str(Path(work) / "units"), "--json"]
        command += ["--quant", args.quant]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"peerd shard failed: {done.stderr.strip()}")
        summary = json.loads(done.stdout)
        stats = summary["stats"]
        print(f"checkpoint: {QWEN_7B_WIDTH}, float16 on disk, quant {args.quant}")
        print(f"peerd shard: {len(summary['units'])} units in {stats['seconds']:.0f}s, "
              f"peak RSS {stats['peak_rss_bytes'] / MB:.0f} MB")
        units_dir = Path(summary["directory"])
        for index in (0, len(summary["units"]) - 1):
            _report(units_dir, index, model_dir)


def _report(units_dir: Path, index: int, model_dir: Path) -> None:
    from shards.manifest import Manifest

    unit = Manifest.load(units_dir).units[index]
    files = ", ".join(f"{Path(f.name).name[:20]} {f.bytes / MB:.1f} MB" for f in unit.files)
    print(f"unit {index} {unit.name}: weights {unit.weight_bytes / MB:.0f} MB; files: {files}")
    done = subprocess.run([sys.executable, "-m", "bench.big_unit", "--load", str(units_dir),
                           str(index)], capture_output=True, text=True)
    if done.returncode:
        print(f"  DOES NOT LOAD: {done.stderr.strip().splitlines()[-1]}")
        return
    run = json.loads(done.stdout)
    error = _error(run["output"], unit.name, model_dir)
    print(f"  loaded in {run['load_s']:.1f}s, ran in {run['step_s']:.2f}s; output "
          f"{run['output']['name']} {run['output']['shape']}, max |error| vs numpy {error:.2e}")
    for moment in ("loaded", "ran"):
        memory = run[moment]
        print(f"  RSS {moment:6}: {memory['VmRSS']:6} MB (anonymous {memory['RssAnon']}, "
              f"file-backed {memory['RssFile']}), peak {memory['VmHWM']} MB")


def _load_and_run(units_dir: Path, index: int) -> dict:
    """In a fresh process: load one unit as a peer does, run one step, report memory."""
    import time

    from shards.executor import StageExecutor
    from shards.manifest import Manifest

    manifest = Manifest.load(units_dir)
    unit = manifest.units[index]
    started = time.perf_counter()
    stage = StageExecutor(manifest, units_dir, index, index)
    loaded, load_s = _memory(), time.perf_counter() - started
    started = time.perf_counter()
    outputs = stage.step("s", _inputs(unit, manifest.model.hidden_size))
    step_s = time.perf_counter() - started
    name = "logits" if "logits" in outputs else f"{unit.name}.hidden"
    np.save(units_dir / f"output-{index}.npy", outputs[name])
    return {"load_s": load_s, "step_s": step_s, "loaded": loaded, "ran": _memory(),
            "output": {"name": name, "shape": list(outputs[name].shape),
                       "path": str(units_dir / f"output-{index}.npy")}}


def _inputs(unit, hidden: int) -> dict[str, np.ndarray]:
    inputs = {}
    for spec in unit.inputs:
        if spec.dtype == "int64":
            inputs[spec.name] = np.array(IDS) if spec.name == "input_ids" else np.arange(3)[None]
        else:
            inputs[spec.name] = _hidden(hidden)
    return inputs


def _hidden(width: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((1, 3, width), np.float32)


def _error(output: dict, name: str, model_dir: Path) -> float:
    """Max |difference| between the unit's output and numpy on the checkpoint's weights."""
    got = np.load(output["path"])
    if name == "embed":
        want = _weight(model_dir, "model.embed_tokens.weight")[IDS[0]][None]
    else:
        norm = _weight(model_dir, "model.norm.weight")
        x = _hidden(len(norm))
        normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * norm
        want = normed @ _weight(model_dir, "lm_head.weight").T
    return float(np.max(np.abs(got - want)))


def _weight(model_dir: Path, name: str) -> np.ndarray:
    from safetensors import safe_open

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    with safe_open(str(model_dir / index["weight_map"][name]), "numpy") as f:
        return f.get_tensor(name).astype(np.float32)


def _memory() -> dict[str, int]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(status[key].split()[0]) // 1024
            for key in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quant", choices=[q.value for q in Quant], default=Quant.NONE.value,
                   help="how the units store their weights (default none: float32)")
    p.add_argument("--work", help="directory for the checkpoint and units (default: /tmp)")
    p.add_argument("--load", nargs=2, metavar=("UNITS_DIR", "INDEX"), help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    main()
